"""One-rank training step time of our Transformer (eager, and with compile=true's regional compilation)
against transformers' LlamaForCausalLM, and against a limit measured in the same run.

Same dimensions, same weights (ours copied into HF through the exporter's name mapping), same batch,
fp32 on CPU. A step is forward + cross-entropy + backward + AdamW. The models take turns step by step
(the order rotating), so machine noise hits all alike; the reported ratios are medians of per-step
ratios. The step-1 losses must agree: same weights, same math (compiled: within 1e-5).

The limit row is this process's fp32 GEMM throughput at the step's own block GEMM shapes
(gemm_limit.py), a pass of them timed in turn with the steps; every row also reads as a share of it:
model FLOPs / step time / limit (the median of per-step shares).

    python scripts/bench/step.py [--model tiny|small] [--batch 4] [--seq 256] [--threads 2] [--quick]
"""

import sys
from pathlib import Path

# Scripts run from a checkout without installing the package.
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch import nn  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from model.args import ModelArgs  # noqa: E402
from model.init import init_weights  # noqa: E402
from model.transformer import Transformer  # noqa: E402
from parallel.regional_compile import STATS, compile_forward  # noqa: E402
from scripts.bench.agreement import require_agreement  # noqa: E402
from scripts.bench.gemm_limit import GemmPass  # noqa: E402
from scripts.export_hf import hf_config, to_hf  # noqa: E402
from trainer.config.schema import from_dict  # noqa: E402
from trainer.data.tokenizer_spm import BOS_ID, EOS_ID  # noqa: E402
from trainer.observability.flops import training_flops_per_token  # noqa: E402


def model_args(name: str, seq_len: int) -> ModelArgs:
    """Dimensions from conf/model/{name}.yaml, through the trainer's own config checks."""
    raw = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml"))
    return from_dict({"model": raw, "seq_len": seq_len}).model


FUSED = "ours compile=true optim.fused=true"


def build_models(args: ModelArgs, seed: int) -> dict[str, nn.Module]:
    """ours (eager), ours with each block's forward compiled (compile=true), that with torch's fused
    AdamW (optim.fused=true's kernel), and HF, all with ours' weights."""
    ours = Transformer(args)
    init_weights(ours, args, seed)
    compiled, fused = Transformer(args), Transformer(args)
    for model in (compiled, fused):
        model.load_state_dict(ours.state_dict())
        for block in model.layers.values():
            compile_forward(block)
    # sdpa on both sides: the comparison is of the models around attention, not of attention kernels.
    config = LlamaConfig(**hf_config(args, "float32", BOS_ID, EOS_ID), attn_implementation="sdpa", use_cache=False)
    hf = LlamaForCausalLM(config)
    hf.load_state_dict({n: t.detach().clone() for n, t in to_hf(ours.state_dict(), ours.args).items()}, strict=True)
    return {"ours": ours.train(), "ours compile=true": compiled.train(), FUSED: fused.train(), "HF": hf.train()}


def make_step(model: nn.Module, logits_of: Callable[[torch.Tensor], torch.Tensor], fused: bool = False) -> Callable:
    """Returns step(tokens, targets) -> (loss, seconds); the optimizer lives in the closure (torch's
    single-tensor AdamW, as the trainer's default runs it, or its fused kernel)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False, fused=fused or None)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
        start = time.perf_counter()
        logits = logits_of(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), time.perf_counter() - start

    return step


LIMIT = "limit: fp32 GEMMs at the step's block GEMM shapes"


def run(args: ModelArgs, batch: int, warmup: int, steps: int, seed: int) -> dict:
    models = build_models(args, seed)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, args.vocab_size, (batch, args.max_seq_len + 1), generator=gen)
    tokens, targets = data[:, :-1], data[:, 1:]
    gemms = GemmPass(args, batch * args.max_seq_len)
    steppers = {name: make_step(m, (lambda t, m=m: m(input_ids=t).logits) if name == "HF" else m, name == FUSED)
                for name, m in models.items()} | {LIMIT: lambda tokens, targets: (0.0, gemms())}
    times: dict[str, list[float]] = {name: [] for name in steppers}
    first_losses: dict[str, float] = {}
    for i in range(warmup + steps):
        names = list(steppers)
        for name in names[i % len(names):] + names[: i % len(names)]:
            loss, seconds = steppers[name](tokens, targets)
            first_losses.setdefault(name, loss)
            if i == 0 and name == "ours compile=true":
                compile_seconds = seconds
            if i >= warmup:
                times[name].append(seconds)
    del first_losses[LIMIT]
    return {"times": times, "losses": first_losses, "limit_flops": gemms.flops, "compile_s": compile_seconds}


def table(name: str, args: ModelArgs, tokens_per_step: int, result: dict) -> str:
    times = result["times"]
    step_flops = training_flops_per_token(args, args.max_seq_len) * tokens_per_step
    # A step's time at the limit, per step (the pass measured in the same turn): step FLOPs / limit.
    at_limit = [step_flops / (result["limit_flops"] / t) for t in times[LIMIT]]
    rows = ["| model | row | tokens/s | step time / ours eager (median) | model GFLOP/s | share of the limit |",
            "|---|---|---:|---:|---:|---:|"]
    for row, seconds in times.items():
        if row == LIMIT:
            seconds = at_limit
        median = statistics.median(seconds)
        ratio = statistics.median(t / o for t, o in zip(seconds, times["ours"]))
        share = statistics.median(limit / t for t, limit in zip(seconds, at_limit))
        rows.append(f"| {name} | {row} | {tokens_per_step / median:,.0f} | {ratio:.3f} "
                    f"| {step_flops / median / 1e9:.1f} | {share:.2f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "small"), default="small")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="1 warmup + 3 timed steps: a smoke run")
    opts = parser.parse_args(argv)
    warmup, steps = (1, 3) if opts.quick else (opts.warmup, opts.steps)
    # Explicit, so numbers are comparable across machines with different default thread counts.
    torch.set_num_threads(opts.threads)
    result = run(model_args(opts.model, opts.seq), opts.batch, warmup, steps, opts.seed)
    print(f"batch {opts.batch} x seq {opts.seq}, fp32, CPU, {opts.threads} threads, {warmup} warmup + {steps} "
          f"timed steps, torch {torch.__version__}, transformers {transformers.__version__}\n")
    print(table(opts.model, model_args(opts.model, opts.seq), opts.batch * opts.seq, result))
    losses = result["losses"]
    print(f"\ncompile=true: {STATS.graphs} graph(s), compiled during step 1 ({result['compile_s']:.1f} s with it)")
    for name, rtol in (("HF", 1e-6), ("ours compile=true", 1e-5), (FUSED, 1e-5)):
        gap = abs(losses[name] - losses["ours"]) / abs(losses["ours"])
        print(require_agreement(f"step-1 losses of ours and {name}", gap, rtol=rtol))


if __name__ == "__main__":
    main()
