"""Our FSDP against PyTorch FSDP2 and DDP: step time, bytes communicated, peak RSS; dp gloo ranks on CPU (4 unless --world).

Each configuration steps the optimizer its users would use: ours the trainer's AdamW over the flat
fp32 shards (four tensors for model=tiny), FSDP2, DDP and the limit row torch's AdamW with
`foreach=True` (torchtitan's choice; CPU's default would be a for-loop over every DTensor). Forward +
backward time (up to gradients ready) is reported apart from the whole step, and so is `comm_wait`:
the time ours spent blocked on communication (parallel.comm's exposed-comm clock; FSDP2 and DDP do not
expose theirs). Ours also runs with its gradient reductions synchronous (`reductions_in_flight=0`) and
with `grad_reduce=per_microbatch`. The limit row is the same per-rank work (model, microbatches,
optimizer over the whole model) on each rank with no communication at all; the "comm alone" row is the
opposite: ours' ZeRO-3 collectives with no compute.

Same model (conf/model/{tiny,small}.yaml), same weights, same data; fp32, 1 thread per rank, microbatch
size 1, M microbatches per step with gradient sync only on the last one (ours: `set_microbatch`, with
optimize_backward_concat=true, one flat-gradient concat per unit per step, as FSDP2's per-parameter
gradients need none;
FSDP2: `set_requires_gradient_sync`; DDP: `no_sync()`). With reshard_after_forward=False, FSDP2 also
gets `set_reshard_after_backward(is_last)` so that, like ours, it keeps parameters unsharded across the
step's microbatches instead of re-gathering per microbatch. FSDP2 does not get
`set_is_last_backward(is_last)`: on CPU it saves nothing (no reduce-scatter is pending on non-last
microbatches) and in torch 2.13 it costs one wasted all-gather per step: the backward-prefetch order
is only cleared on a last backward, so on the last microbatch the embedding's prefetch targets the
previous microbatch's head, re-gathers it after its reshard, and finalize discards it.

Timing: every configuration lives in the same processes and they run interleaved by rounds (each
round: K steps of each configuration, the order rotating per round), so machine noise hits them alike.
A step's time is the slowest rank's; the table gives the median, and the ratio against FSDP2 with the
same reshard setting is the median over rounds of per-round median ratios (DDP against FSDP2 without
resharding: both keep full parameters through the step).

Bytes per step use the ledger convention (parallel/comm.py: gathered output for all-gather, unreduced
input for reduce-scatter, the tensor for all-reduce), not wire bytes. Ours: `parallel.comm.LEDGER`.
FSDP2: measured by wrapping `torch.distributed.all_gather_single` / `reduce_scatter_single` (what FSDP2
calls; the older names before torch 2.13) in this script only. DDP: its C++ reducer bypasses Python,
so one all-reduce per bucket, sizes taken from DDP's own logging data (`rebuilt_bucket_sizes`, the
layout after its first step), valid because every parameter gets a gradient.

Memory: ru_maxrss is a process-wide high-water mark with no portable reset, so in the shared timing
processes it would only show the largest configuration. Peak RSS is therefore measured in fresh
processes, one spawn per configuration; the table gives the max over ranks of the peak, and of the
increment over the same rank's ru_maxrss just before the model is built (torch + gloo baseline; every
configuration first builds a throwaway torch AdamW, whose import of torch._dynamo would otherwise
count against FSDP2, DDP and the limit only). The peak includes building the full model on every
rank, as all three do. RSS high-water marks also carry the C allocator's arenas and fragmentation,
which move them by tens of MiB between runs of the same code. "Peak tensor" is steadier: the most
tensor bytes alive at once during the steps, the CPU analog of CUDA's max_memory_allocated, from the
memory events of torch's profiler, which runs from before the model is built. The profiler counts
tensors allocated and freed on threads that carry its state; a tensor whose last reference a gloo
worker thread drops (gloo's reduce-scatter keeps a copy of its input, made on the calling thread) is
freed unseen. Such a block is subtracted once its address is allocated again, which shows it was
freed; until then the total reads high, never low, by an amount that depends on timing. The table
gives the minimum over --memory-repeats fresh runs (the least inflated) and the range. Gloo's
internal buffers, and memory outside torch's allocator, are not counted.

    python scripts/bench/fsdp.py [--model tiny|small] [--world 4] [--seq 128] [--rounds 10] [--steps-per-round 3] [--quick]

Ranks are spawned by the script itself (torch.multiprocessing, no torchrun). The configurations and how
each runs a step live in fsdp_runners.py.
"""

import sys
from pathlib import Path

# Scripts run from a checkout without installing the package.
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.profiler import ProfilerActivity, profile, record_function  # noqa: E402

from model.args import ModelArgs  # noqa: E402
from parallel import comm  # noqa: E402
from parallel.mesh import ParallelDims, ParallelMesh  # noqa: E402
from scripts.bench.agreement import require_agreement, worst  # noqa: E402
from scripts.bench.fsdp_runners import SEED, Config, Runner, build, count_torch_collectives  # noqa: E402
from scripts.bench.ranks import spawn  # noqa: E402
from trainer.config.schema import from_dict  # noqa: E402

CONFIGS = (Config("ours", False), Config("fsdp2", False), Config("ours", True), Config("fsdp2", True),
           Config("ours", True, in_flight=0), Config("ours", True, grad_reduce="per_microbatch"), Config("ddp"),
           Config("limit"), Config("comm", True))
STEP_MARK = "bench_step"  # a profiler range around each step, to find where the steps begin


def model_args(name: str, seq_len: int) -> ModelArgs:
    """Dimensions from conf/model/{name}.yaml, through the trainer's own config checks."""
    raw = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml"))
    return from_dict({"model": raw, "seq_len": seq_len}).model


def rank_batch(args: ModelArgs, microbatches: int, step: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's microbatches (size 1) of the step's global batch."""
    gen = torch.Generator().manual_seed(SEED + step)
    tokens = torch.randint(0, args.vocab_size, (dist.get_world_size() * microbatches, args.max_seq_len + 1), generator=gen)
    mine = tokens[rank * microbatches : (rank + 1) * microbatches]
    return [(t[None, :-1], t[None, 1:]) for t in mine]


def timed_step(runner: Runner, batch: list) -> tuple[tuple[float, float, float | None], float, dict]:
    """((step s, forward+backward s, comm wait s), local loss sum, comm) of one step, ranks aligned by a
    barrier outside the timing."""
    comm.barrier(comm.world())
    runner.reset_comm()
    start = time.perf_counter()
    loss = runner.step(batch)
    return (time.perf_counter() - start, runner.forward_backward_s, runner.comm_wait_s()), loss, runner.comm()


# --- phase 1: interleaved timing in one set of processes ------------------------------------------
def time_all(rank: int, world: int, args: ModelArgs, microbatches: int, warmup: int, rounds: int, k: int) -> dict:
    count_torch_collectives()
    mesh = ParallelMesh(ParallelDims.from_sizes(world), "cpu")
    runners = {cfg: build(cfg, args, microbatches, mesh) for cfg in CONFIGS}
    times: dict[Config, list[list[float]]] = {cfg: [] for cfg in CONFIGS}
    steps_done = dict.fromkeys(CONFIGS, 0)  # every configuration sees the same batches in the same order
    losses: dict[Config, float] = {}
    comms: dict[Config, dict] = {}
    for r in range(-1, rounds):  # round -1: warmup, untimed
        shift = r % len(CONFIGS)
        for cfg in CONFIGS[shift:] + CONFIGS[:shift]:
            round_times = []
            for _ in range(warmup if r < 0 else k):
                batch = rank_batch(args, microbatches, steps_done[cfg], rank)
                seconds, losses[cfg], comms[cfg] = timed_step(runners[cfg], batch)
                steps_done[cfg] += 1
                round_times.append(seconds)
            if r >= 0:
                times[cfg].append(round_times)
    gathered = comm.all_gather_object((times, losses), comm.world())
    return {"times": slowest_rank(gathered), "losses": global_losses(gathered, args, microbatches), "comm": comms}


def slowest_rank(gathered: list) -> dict[Config, list[list[tuple]]]:
    """Per configuration, round and step: (step, forward+backward, comm wait) times, each the max over
    ranks (None where not measured)."""
    per_rank = [times for times, _ in gathered]

    def worst(samples: tuple) -> tuple:
        return tuple(None if part[0] is None else max(part) for part in zip(*samples))

    return {cfg: [[worst(ts) for ts in zip(*rounds)] for rounds in zip(*(t[cfg] for t in per_rank))]
            for cfg in CONFIGS}


def global_losses(gathered: list, args: ModelArgs, microbatches: int) -> dict[Config, float]:
    tokens = len(gathered) * microbatches * args.max_seq_len
    return {cfg: sum(losses[cfg] for _, losses in gathered) / tokens for cfg in CONFIGS}


# --- phase 2: peak memory, fresh processes per configuration --------------------------------------
def peak_rss(rank: int, world: int, cfg: Config, args: ModelArgs, microbatches: int, steps: int) -> dict:
    mesh = ParallelMesh(ParallelDims.from_sizes(world), "cpu")
    # torch.optim.AdamW's first construction imports torch._dynamo (~30 MiB of RSS); ours never builds
    # one. Pay it before the baseline in every configuration, so the peaks compare the training alone.
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)], foreach=True)
    baseline = maxrss_mib()
    runner = build(cfg, args, microbatches, mesh)
    for step in range(steps):
        runner.step(rank_batch(args, microbatches, step, rank))
    gathered = comm.all_gather_object((maxrss_mib(), baseline), comm.world())
    return {"peak": max(p for p, _ in gathered), "increment": max(p - b for p, b in gathered)}


def peak_tensors(rank: int, world: int, cfg: Config, args: ModelArgs, microbatches: int, steps: int) -> float:
    """The most tensor bytes (MiB) alive at once during the steps, max over ranks, as the profiler's
    memory events count them from before the model is built (see the module docstring)."""
    mesh = ParallelMesh(ParallelDims.from_sizes(world), "cpu")
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner = build(cfg, args, microbatches, mesh)
        for step in range(steps):
            with record_function(STEP_MARK):
                runner.step(rank_batch(args, microbatches, step, rank))
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        events = json.loads(Path(f"{tmp}/trace.json").read_text())["traceEvents"]
    start = min(e["ts"] for e in events if e.get("name") == STEP_MARK)
    return max(comm.all_gather_object(peak_allocated(events, start) / 2**20, comm.world()))


def peak_allocated(events: list[dict], start_ts: float) -> int:
    """The highest running total of the profiler's memory events from `start_ts` on, less the blocks
    freed unseen: a block whose address is allocated again without a recorded free was freed where
    the profiler could not see it."""
    live: dict[int, int] = {}  # address -> bytes, as far as the recorded events know
    unseen_frees = peak = 0
    for event in sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: e["ts"]):
        addr, nbytes = event["args"]["Addr"], event["args"]["Bytes"]
        if nbytes > 0:
            unseen_frees += live.get(addr, 0)
            live[addr] = nbytes
        else:
            live.pop(addr, None)
        if event["ts"] >= start_ts:
            peak = max(peak, event["args"]["Total Allocated"] - unseen_frees)
    return peak


def check_losses_agree(losses: dict[Config, float]) -> str:
    """Every configuration that trains the global batch ends at FSDP2's loss (the limit row trains each
    rank's batch alone, the comm row nothing)."""
    reference = losses[Config("fsdp2", False)]
    diffs = [abs(losses[c] - reference) / abs(reference) for c in CONFIGS if c.kind in ("ours", "fsdp2", "ddp")]
    return require_agreement("last-step losses of ours, FSDP2 and DDP", worst(diffs), rtol=1e-5)


def maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


# --- report --------------------------------------------------------------------------------------
def reference_of(cfg: Config) -> Config:
    return Config("fsdp2", cfg.reshard)


def ratio(times: dict[Config, list[list[tuple]]], cfg: Config, reference: Config, part: int = 0) -> float:
    """Median over rounds of the per-round ratio of median times (part 0: step, 1: forward+backward)."""
    return statistics.median(statistics.median(s[part] for s in a) / statistics.median(s[part] for s in b)
                             for a, b in zip(times[cfg], times[reference]))


def median_ms(times: list[list[tuple]], part: int) -> str:
    values = [s[part] for rnd in times for s in rnd]
    return "-" if values[0] is None else f"{statistics.median(values) * 1e3:.1f}"


def comm_cell(ops: dict[str, dict[str, int]]) -> tuple[str, str]:
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
    counts = ", ".join(f"{short.get(op, op)} {v['count']}" for op, v in ops.items())
    return f"{sum(v['bytes'] for v in ops.values()) / 2**20:.2f}", counts


def lowest(values: list[float]) -> str:
    """The minimum of repeats that can only read high, and their highest where they differ."""
    low, high = min(values), max(values)
    return f"{low:.1f}" + (f" (to {high:.1f})" if high - low >= 0.1 else "")


def table(timing: dict, memory: dict[Config, dict]) -> str:
    lines = [
        "| config | step ms | fwd+bwd ms | comm wait ms | step vs FSDP2 same reshard | fwd+bwd vs limit "
        "| comm MiB/step | collectives/step | peak tensor MiB | peak RSS MiB (max rank) | RSS increment MiB "
        "| loss, last step |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    times = timing["times"]
    for cfg in CONFIGS:
        mib, counts = comm_cell(timing["comm"][cfg])
        mem = memory[cfg]
        vs_fsdp2 = f"{ratio(times, cfg, reference_of(cfg)):.3f}" if cfg.kind in ("ours", "fsdp2") else "-"
        if cfg.kind == "ddp":
            vs_fsdp2 = f"{ratio(times, cfg, Config('fsdp2', False)):.3f} (vs reshard=False)"
        lines.append(
            f"| {cfg.label} | {median_ms(times[cfg], 0)} | {median_ms(times[cfg], 1)} | {median_ms(times[cfg], 2)} "
            f"| {vs_fsdp2} | {ratio(times, cfg, Config('limit'), part=1):.3f} | {mib} | {counts} "
            f"| {lowest(mem['tensors'])} | {mem['peak']:.0f} | {mem['increment']:.0f} | {timing['losses'][cfg]:.6f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--world", type=int, default=4, help="data-parallel gloo ranks")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--memory-repeats", type=int, default=3, help="fresh runs per configuration (peak tensor)")
    parser.add_argument("--quick", action="store_true", help="1 warmup step, 2 rounds of 1 step, 1 memory step, 1 repeat")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.warmup, opts.rounds, opts.steps_per_round, opts.memory_steps, opts.memory_repeats = 1, 2, 1, 1, 1
    args = model_args(opts.model, opts.seq)
    timing = spawn(opts.world, time_all, args, opts.microbatches, opts.warmup, opts.rounds, opts.steps_per_round)
    memory = {cfg: spawn(opts.world, peak_rss, cfg, args, opts.microbatches, opts.memory_steps) for cfg in CONFIGS}
    for cfg in CONFIGS:
        memory[cfg]["tensors"] = [spawn(opts.world, peak_tensors, cfg, args, opts.microbatches, opts.memory_steps)
                                  for _ in range(opts.memory_repeats)]
    print(f"model {opts.model}, dp={opts.world} gloo ranks on CPU, 1 thread each, fp32, {opts.microbatches} microbatches "
          f"of 1 x {opts.seq} per step; {opts.rounds} rounds x {opts.steps_per_round} steps per configuration "
          f"after {opts.warmup} warmup; memory: {opts.memory_steps} steps, {opts.memory_repeats} repeats "
          f"(peak tensor); torch {torch.__version__}\n")
    print(table(timing, memory))
    print("\n" + check_losses_agree(timing["losses"]))


if __name__ == "__main__":
    main()
