"""checkpoint.async_save reports what each save costs the step loop: the completion on the main thread
(its checks, any wait for the write, manifest, rename, pruning) is timed, not only the start."""

import re
import time
from functools import cache

import torch
import torch.distributed as dist

from scripts.bench.checkpoint import stalls_per_save
from trainer.checkpoint import async_save
from trainer.checkpoint.async_save import AsyncCheckpointer

SLOW_PRUNE_S = 0.3


def state(seed: int) -> dict:
    return {"model": {"w": torch.randn(4, 3, generator=torch.Generator().manual_seed(seed))}}


def test_the_completion_of_a_save_reports_its_main_thread_time(tmp_path, world, monkeypatch):
    prune = async_save.prune_checkpoints

    def slow_prune(root, keep: int) -> None:
        time.sleep(SLOW_PRUNE_S)
        prune(root, keep)

    monkeypatch.setattr(async_save, "prune_checkpoints", slow_prune)
    lines: list[str] = []
    saver = AsyncCheckpointer(tmp_path, world, cache(lambda: dist.new_group(backend="gloo")), 0, keep=1,
                              extra_files={}, log=lines.append, device=torch.device("cpu"))
    saver.save(1, state(1))
    while saver.in_flight is not None:  # completed by a poll at a step boundary
        saver.poll()
    saver.save(2, state(2))
    saver.wait()  # completed by a wait (the next save, the end of training)
    completed = [re.fullmatch(r"saved checkpoint \S*step_(\d) \(written in the background; the step loop "
                              r"stalled ([0-9.]+) s completing it\)", line) for line in lines]
    assert all(completed) and [int(m[1]) for m in completed] == [1, 2], lines
    assert all(float(m[2]) >= SLOW_PRUNE_S for m in completed), lines
    # The checkpoint benchmark adds each save's parts: here its completion, with the start line run.py logs.
    start = "saving checkpoint of step 2 in the background (the step loop stalled 0.050 s)"
    assert stalls_per_save("\n".join([start, *lines])) == {1: [float(completed[0][2])],
                                                            2: [0.05, float(completed[1][2])]}


def test_the_background_write_makes_no_cuda_call(tmp_path, world, monkeypatch):
    """DCP's writer thread is never given a device: a CUDA stream call there opens a context on GPU 0, from
    every rank of a node. The state is staged to host memory first, so the write needs none; here CUDA
    reads as available and any stream call in the thread is recorded."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: calls.append("current_stream"))
    saver = AsyncCheckpointer(tmp_path, world, cache(lambda: dist.new_group(backend="gloo")), 0, keep=1,
                              extra_files={}, log=lambda line: None, device=torch.device("cpu"))
    saver.save(1, state(1))
    saver.wait()
    assert calls == [] and (tmp_path / "step_1").is_dir()
