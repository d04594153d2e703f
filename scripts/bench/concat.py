"""optimize_backward_concat on vs off, side by side: step time and flat-gradient concats per step.

Without the option every microbatch's backward concatenates its per-parameter gradients into the
unit's fp32 flat gradient accumulator (one autograd node, `CONCAT_EVENT`, per unit); with it,
only the last microbatch concatenates and the earlier ones add each parameter's gradient straight into
the accumulator. Both give bitwise-identical losses (checked here too).

Setup: the trainer's own step (StepRunner.build, random tokens) on 2 gloo CPU ranks (dp_shard=2, ZeRO-2:
reshard_after_forward=false), fp32, microbatches of one sequence, for M in {1, 4, 8}. Both configs of
one M live in the same processes and run interleaved by rounds (each round: one step of each), so
machine noise hits them alike; the step time is the slowest rank's, medians over rounds, ratio = median
of per-round ratios. Concats are counted with the autograd profiler on one extra step.

    python scripts/bench/concat.py [--model small] [--seq 256] [--rounds 5] [--quick]
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.autograd.profiler import profile  # noqa: E402

from parallel import comm  # noqa: E402
from parallel.fsdp import CONCAT_EVENT  # noqa: E402
from parallel.mesh import ParallelMesh  # noqa: E402
from scripts.bench.ranks import spawn  # noqa: E402
from scripts.bench.trainer_step import RandomTokens, step_bench_options  # noqa: E402
from trainer.config.rules import validate  # noqa: E402
from trainer.config.schema import TrainConfig, from_dict  # noqa: E402
from trainer.step import StepRunner  # noqa: E402

WORLD = 2
MICROBATCHES = (1, 4, 8)


def bench_config(model: str, seq: int, microbatches: int, optimize: bool) -> TrainConfig:
    raw = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{model}.yaml"))
    return from_dict({"model": raw, "seq_len": seq, "batch_size": microbatches, "reshard_after_forward": False,
                      "optimize_backward_concat": optimize})


def count_concats(trainer, step: int) -> int:
    with profile(record_shapes=True) as prof:
        trainer.train_step(step)
    return sum(1 for e in prof.function_events if e.name == CONCAT_EVENT)


def timed_step(trainer, step: int) -> tuple[float, float]:
    comm.barrier(comm.world())
    start = time.perf_counter()
    loss = trainer.train_step(step).loss
    slowest = torch.tensor([time.perf_counter() - start])
    comm.all_reduce(slowest, comm.world(), op=torch.distributed.ReduceOp.MAX)
    return slowest.item(), loss


def run(rank: int, world: int, model: str, seq: int, rounds: int) -> list[dict]:
    rows = []
    for m in MICROBATCHES:
        trainers = {}
        for optimize in (False, True):
            cfg = bench_config(model, seq, m, optimize)
            trainers[optimize] = StepRunner.build(cfg, ParallelMesh(validate(cfg, world), "cpu"), RandomTokens(cfg, rank),
                                               torch.device("cpu"))
        times: dict[bool, list[float]] = {False: [], True: []}
        losses: dict[bool, list[float]] = {False: [], True: []}
        for step in range(1, rounds + 2):
            for optimize, trainer in trainers.items():
                elapsed, loss = timed_step(trainer, step)
                losses[optimize].append(loss)
                if step > 1:  # the first step warms up
                    times[optimize].append(elapsed)
        concats = {optimize: count_concats(trainer, rounds + 2) for optimize, trainer in trainers.items()}
        ratios = [on / off for on, off in zip(times[True], times[False])]
        rows.append({"m": m, "off": statistics.median(times[False]), "on": statistics.median(times[True]),
                     "ratio": statistics.median(ratios), "concats": concats,
                     "units": sum(len(root.units) for root in trainers[True].roots),
                     "bitwise": losses[True] == losses[False]})
    return rows


def main() -> None:
    opts = step_bench_options(__doc__)
    rows = spawn(WORLD, run, opts.model, opts.seq, opts.rounds)
    print(f"optimize_backward_concat, {opts.model}, seq {opts.seq}, {WORLD} gloo ranks (ZeRO-2), fp32:")
    print("| M | off ms | on ms | on/off | concats/step off | concats/step on | losses bitwise equal |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['m']} | {r['off'] * 1e3:.1f} | {r['on'] * 1e3:.1f} | {r['ratio']:.3f} | "
              f"{r['concats'][False]} | {r['concats'][True]} | {'yes' if r['bitwise'] else 'NO'} |")
    print(f"(units per rank: {rows[0]['units']}; off concatenates once per unit per microbatch, on once per unit)")


if __name__ == "__main__":
    main()
