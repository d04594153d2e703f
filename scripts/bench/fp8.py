"""fp8 side by side: (1) the block's GEMMs in fp8 vs bf16 vs fp32, (2) FSDP's fp8 all-gather on vs off.

(1) One process, the device of the machine (CUDA if present). For each TP-local linear of the model's
block (tokens = one microbatch of --seq), the time of y = x W^T as the trainer runs it: fp32 and bf16
matmuls, and fp8 = casting x to fp8 plus the scaled GEMM (the weight's cast is cached across a step's
microbatches, so it is left out). A CPU has no fp8 units: the CPU numbers are a report, not a target.

(2) 4 gloo CPU ranks (dp_shard=4), the trainer's own step (StepRunner.build, fp8 linears, ZeRO-3,
fp32 compute) with model.fp8_all_gather off and on: all-gather bytes per step from the ledger and the
step time; bf16's bytes are the fp32 gather's halved (two bytes per element instead of four). Configs
run interleaved by rounds, so machine noise hits both alike; medians over rounds.

    python scripts/bench/fp8.py [--model small] [--seq 256] [--rounds 5] [--quick]
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from model.fp8 import Fp8Recipe, quantize, scaled_mm  # noqa: E402
from parallel.mesh import ParallelMesh  # noqa: E402
from scripts.bench.ranks import spawn  # noqa: E402
from scripts.bench.trainer_step import RandomTokens, step_bench_options  # noqa: E402
from trainer.config.rules import fp8_gemm_sizes, validate  # noqa: E402
from trainer.config.schema import TrainConfig, from_dict  # noqa: E402
from trainer.step import StepRunner  # noqa: E402

WORLD = 4


def bench_config(model: str, seq: int, **overrides) -> TrainConfig:
    raw = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{model}.yaml"))
    return from_dict({"model": raw | overrides, "seq_len": seq, "batch_size": 2, "reshard_after_forward": True})


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_table(cfg: TrainConfig, repeats: int) -> list[str]:
    args = cfg.model
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    q, kv, ffn, tokens = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.ffn_hidden_dim, cfg.seq_len
    shapes = {"wqkv": (args.dim, q + 2 * kv), "wo": (q, args.dim), "w13": (args.dim, 2 * ffn), "w2": (ffn, args.dim)}
    recipe, one = Fp8Recipe(), torch.ones((), device=device)
    rows = [f"GEMMs on {device.type}, {tokens} tokens ({cfg.model.name}):",
            "| linear | in x out | fp32 ms | bf16 ms | fp8 ms | fp8 / bf16 |", "|---|---|---|---|---|---|"]
    for name, (k, n) in shapes.items():
        x, w = torch.randn(tokens, k, device=device), torch.randn(n, k, device=device) * 0.02
        xb, wb = x.bfloat16(), w.bfloat16()
        w8 = quantize(w, one * 1000, recipe.forward_dtype)
        fp32 = median_time(lambda: x @ w.t(), repeats)
        bf16 = median_time(lambda: xb @ wb.t(), repeats)
        fp8 = median_time(lambda: scaled_mm(quantize(xb, one, recipe.forward_dtype), w8, one, one / 1000,
                                            torch.bfloat16), repeats)
        rows.append(f"| {name} | {k} x {n} | {fp32 * 1e3:.3f} | {bf16 * 1e3:.3f} | {fp8 * 1e3:.3f} | {fp8 / bf16:.2f} |")
    return rows


def gather_bench(rank: int, world: int, model: str, seq: int, rounds: int) -> dict:
    trainers = {}
    for on in (False, True):
        cfg = bench_config(model, seq, use_fp8=True, fp8_all_gather=on)
        trainers[on] = StepRunner.build(cfg, ParallelMesh(validate(cfg, world), "cpu"), RandomTokens(cfg, rank),
                                     torch.device("cpu"))
    times: dict[bool, list[float]] = {False: [], True: []}
    gathered: dict[bool, int] = {}
    for step in range(1, rounds + 2):
        for on, trainer in trainers.items():
            metrics = trainer.train_step(step)
            if step > 1:  # the first step warms up
                times[on].append(metrics.step_time_s)
            gathered[on] = metrics.comm["all_gather"]["bytes"]
    # Embedding and head stay in the compute dtype: their gathers (before each forward and backward)
    # are the same in both configs; the rest is the blocks'.
    trainer = trainers[False]
    outside_blocks = sum(u.spec.padded * 4 for root in trainer.roots for u in root.units if not u.name.startswith("layers."))
    outside_blocks *= 2 * trainer.cfg.num_microbatches
    blocks = {on: total - outside_blocks for on, total in gathered.items()}
    return {"bytes": gathered, "blocks": blocks, "time": {on: statistics.median(t) for on, t in times.items()}}


def main() -> None:
    opts = step_bench_options(__doc__)
    cfg = bench_config(opts.model, opts.seq, use_fp8=True)
    validate(cfg, WORLD)
    assert all(size % 16 == 0 for _, size in fp8_gemm_sizes(cfg))
    print("\n".join(gemm_table(cfg, repeats=3 if opts.quick else 10)))
    result = spawn(WORLD, gather_bench, opts.model, opts.seq, opts.rounds)
    off, on = result["bytes"][False], result["bytes"][True]
    block_off, block_on = result["blocks"][False], result["blocks"][True]
    print(f"\nFSDP all-gather per step, {WORLD} CPU ranks, ZeRO-3, {opts.model}, seq {opts.seq}:")
    print("| all-gather | bytes/step | vs bf16 | blocks only | vs bf16 | step s |\n|---|---|---|---|---|---|")
    print(f"| compute dtype fp32 | {off:,} | 2.00 | {block_off:,} | 2.00 | {result['time'][False]:.3f} |")
    print(f"| compute dtype bf16 (= fp32 / 2) | {off // 2:,} | 1.00 | {block_off // 2:,} | 1.00 | - |")
    print(f"| fp8 (model.fp8_all_gather=true) | {on:,} | {2 * on / off:.2f} | {block_on:,} | "
          f"{2 * block_on / block_off:.2f} | {result['time'][True]:.3f} |")
    print(f"step time fp8 gather / fp32 gather: {result['time'][True] / result['time'][False]:.2f}")


if __name__ == "__main__":
    main()
