"""Checkpoint stall: how long the step loop waits for a synchronous save vs an asynchronous one
(checkpoint.async_save=true, which stalls only for the copy to host memory), side by side in one run.

    python scripts/bench/checkpoint.py [--model small] [--nproc 2] [--saves 3] [--quick]

Runs train.py under torchrun twice with the same config (a checkpoint every other step) and reads the
stall of each save from the trainer's own log lines: a synchronous save's one figure (the weight check,
the write, manifest, rename and pruning), an asynchronous save's two added (its start: the weight check
and the copy to host memory; its completion: the checks for it, any wait, manifest, rename and
pruning). Each run makes two saves more than --saves, not counted: the first (one-time set-up such as
the asynchronous save's process group) and the last (the end of training waits for an asynchronous
write, with no step left to overlap it). Prints the median stall per mode, their ratio, and the median
step time of each run (an async save writes while the next steps compute: on a machine with few cores
the writer competes with them).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# "saved checkpoint .../step_N (...the step loop stalled X s...)", "saving checkpoint of step N in the background (...)"
_STALL = re.compile(r"checkpoint (?:of step |\S*step_)(\d+)\b.*the step loop stalled ([0-9.]+) s")


def stalls_per_save(log: str) -> dict[int, list[float]]:
    """{step: the stalls its save logged}: one for a synchronous save, start and completion for an
    asynchronous one."""
    stalls: dict[int, list[float]] = {}
    for step, seconds in _STALL.findall(log):
        stalls.setdefault(int(step), []).append(float(seconds))
    return stalls


def run(mode: str, opts: argparse.Namespace, folder: Path) -> tuple[list[float], list[float]]:
    """(stall of each counted save, its parts added; step times) of one training run."""
    steps = 2 * (opts.saves + 2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={opts.nproc}",
           str(REPO / "train.py"), f"dump_dir={folder / mode}", f"data.cache_dir={REPO / '.cache' / 'data'}",
           f"model={opts.model}", f"seq_len={opts.seq}", "batch_size=1", f"steps={steps}", "checkpoint.freq=2",
           "log_all_steps=true", f"checkpoint.async_save={mode == 'async'}"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        sys.exit(f"{mode} run failed:\n{out.stderr[-3000:]}")
    text = out.stdout + out.stderr
    stalls = [sum(parts) for _, parts in sorted(stalls_per_save(text).items())][1:-1]
    metrics = [line for line in (folder / mode / "metrics.jsonl").read_text().splitlines()]
    step_times = [float(re.search(r'"step_time_s": ([0-9.e-]+)', m).group(1)) for m in metrics[1:]]
    return stalls, step_times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--saves", type=int, default=3, help="saves counted per mode (two more are made)")
    parser.add_argument("--quick", action="store_true", help="model=tiny, seq 64, 2 saves")
    opts = parser.parse_args()
    if opts.quick:
        opts.model, opts.seq, opts.saves = "tiny", 64, 2
    with tempfile.TemporaryDirectory() as tmp:
        results = {mode: run(mode, opts, Path(tmp)) for mode in ("sync", "async")}
    print(f"model={opts.model} seq_len={opts.seq}, {opts.nproc} ranks, {opts.saves} saves each")
    print("| mode | median stall per save, s | vs sync | median step time, s |")
    print("|---|---:|---:|---:|")
    sync_stall = statistics.median(results["sync"][0])
    for mode, (stalls, step_times) in results.items():
        stall = statistics.median(stalls)
        print(f"| {mode} | {stall:.3f} | {stall / sync_stall:.3f} | {statistics.median(step_times):.3f} |")


if __name__ == "__main__":
    main()
