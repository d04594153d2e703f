"""Break things on purpose: a worker SIGKILLed anywhere (steps, backward, optimizer, mid-save) under
`torchrun --max-restarts` makes torchrun restart the group, which resumes from the newest complete
checkpoint and ends with the losses of a run that was never interrupted, bit for bit."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.conftest import CHECKPOINTED_RUN
from tests import REPO
from tests.e2e.launch import DATA_CACHE, ENV, assert_one_error, error_lines, free_port, losses, metrics, train

RUN = (*CHECKPOINTED_RUN, "checkpoint.keep=1")


@pytest.fixture(scope="module")
def straight(checkpointed_run) -> dict[int, float]:
    return losses(metrics(checkpointed_run))


def run_with_fault(dump_dir: Path, fault: str, *overrides: str) -> subprocess.CompletedProcess:
    return train(2, dump_dir, *RUN, *overrides, fault=fault, max_restarts=2)


def assert_recovered(proc: subprocess.CompletedProcess, dump_dir: Path, fault: str, straight: dict[int, float]) -> None:
    assert f"killing rank {fault.split(':')[2]} at {':'.join(fault.split(':')[:2])}" in proc.stderr, fault
    assert proc.returncode == 0, (fault, proc.stderr[-4000:])
    records = metrics(dump_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6], fault  # redone steps logged once
    assert losses(records) == straight, fault
    checkpoints = sorted(p.name for p in (dump_dir / "checkpoints").iterdir())
    assert checkpoints == ["step_6"], (fault, checkpoints)  # keep=1; no half-written folder left behind


@pytest.mark.parametrize("fault, async_save", [
    ("save_shards:4:1", False), ("save_rename:4:0", False), ("step_start:2:0", False),
    ("save_shards:4:1", True),  # the background writer killed while the next step runs
])
def test_a_kill_during_a_save_resumes_from_the_previous_checkpoint(tmp_path, straight, fault, async_save):
    """Between shards (the victim's own is written, so the folder holds some shards but no manifest),
    and after the manifest but before the rename, also in checkpoint.async_save's background thread
    while the next step runs: the half-written step_4 is never loaded; step_2 (kept, as pruning only follows a complete save) is.
    Killed before the first checkpoint, the group starts over: the metrics it finds are its own earlier
    attempt's (same job), which move to the superseded file."""
    proc = run_with_fault(tmp_path / "dump", fault, f"checkpoint.async_save={str(async_save).lower()}")
    assert_recovered(proc, tmp_path / "dump", fault, straight)
    output = proc.stdout + proc.stderr
    if fault.startswith("save"):
        assert "resumed from" in output and "step_2 (step 2)" in output
    else:
        assert "resumed from" not in output and "moved 1 record(s)" in output


@pytest.mark.parametrize("fault, resumed_at", [("backward:3:1", 2), ("optimizer:5:0", 4)])
def test_a_kill_in_backward_or_the_optimizer_resumes_from_the_newest_checkpoint(tmp_path, straight, fault,
                                                                                 resumed_at):
    """Mid-step kills: in one rank's backward (its peer waits in a collective) and inside the optimizer
    step (some parameters may already be updated in memory): the restart redoes the step from the
    newest checkpoint, whatever the dead group had half-done."""
    proc = run_with_fault(tmp_path / "dump", fault)
    assert_recovered(proc, tmp_path / "dump", fault, straight)
    assert f"step_{resumed_at} (step {resumed_at})" in proc.stdout + proc.stderr


@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_that_fails_to_write_is_one_error_line_and_keeps_the_previous_checkpoint(tmp_path, async_save):
    """Rank 1's shard of step 4 cannot be written (a full disk): every rank stops with the cause in one
    line, exit 2, instead of a traceback (synchronous) or a hang at the next save (asynchronous: DCP's
    error is a BaseException, which the background thread's handler let escape); step_2 stays."""
    dump = tmp_path / "dump"
    proc = train(2, dump, *RUN, f"checkpoint.async_save={str(async_save).lower()}", fault="write_error:4:1",
                 timeout=180)
    assert_one_error(proc, "No space left on device (faulty_train)")
    assert "exitcode: 2" in proc.stderr, proc.stderr[-3000:]
    assert (dump / "checkpoints" / "step_2" / "manifest.json").is_file()
    assert not (dump / "checkpoints" / "step_4").exists()


def test_a_stalled_rank_times_out_with_one_line_on_every_waiting_rank(tmp_path):
    """Rank 1 of 3 sleeps at step 3's first gradient reduce-scatter: ranks 0 and 2, waiting in it, each
    fail with one line naming the op, the group, the step and the unit, within comm_timeout_s + 20 s
    (the margin covers another test file's ranks sharing the two cores); the job exits non-zero instead
    of hanging."""
    proc = train(3, tmp_path / "dump", "model=tiny", "seq_len=64", "steps=6", "batch_size=1", "comm_timeout_s=5",
                 fault="stall:3:1", timeout=120)
    ended = time.time()
    stalled = float(proc.stderr.split("faulty_train: stalling at ")[1].split()[0])
    assert proc.returncode != 0
    assert ended - stalled < 5 + 20, ended - stalled
    lines = {line.split(":")[0] + ":" + line.split(":")[1]: line for line in error_lines(proc.stderr)}
    assert set(lines) == {"error: rank 0", "error: rank 2"}, proc.stderr[-3000:]
    for line in lines.values():
        # The reduce-scatter of the head, asynchronous, is waited for while layers.1 computes its backward.
        assert "CommTimeout: reduce_scatter of head on group dp_shard_cp did not complete within " \
               "comm_timeout_s=5 (step 3, backward of layers.1)" in line, line


def test_a_kill_on_one_of_two_nodes_restarts_both_into_one_attempt(tmp_path, straight):
    """Two torchrun agents (two nodes of one rank each, one c10d rendezvous): rank 1 dies on its node,
    whose agent counts a restart, while the other node's agent restarts its worker as a membership change
    and counts none. The new group still meets in one namespace of the store (before, the nodes waited
    for each other under attempt_1/ and attempt_0/ until the timeout), and resumes to the straight losses."""
    dump = tmp_path / "dump"
    port = free_port()
    node = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two_nodes", "--max-restarts=1", "--monitor-interval=0.5",
            str(REPO / "tests" / "e2e" / "faulty_train.py"), "step_start:3:1", f"dump_dir={dump}",
            f"data.cache_dir={DATA_CACHE}", *RUN, "comm_timeout_s=60"]
    nodes = [subprocess.Popen(node, cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [proc.communicate(timeout=240) for proc in nodes]
    stderr = "".join(err for _, err in outputs)
    assert [proc.returncode for proc in nodes] == [0, 0], stderr[-4000:]
    assert "killing rank 1 at step_start:3" in stderr
    records = metrics(dump)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert losses(records) == straight
