"""One-rank training step time of our Transformer against transformers' LlamaForCausalLM.

Same dimensions, same weights (ours copied into HF through the exporter's name mapping), same batch,
fp32 on CPU. A step is forward + cross-entropy + backward + AdamW. The two models alternate step by
step (and which one goes first alternates too), so machine noise hits both alike; the reported ratio
is the median of per-step ratios. The step-1 losses must agree: same weights, same math.

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
from scripts.bench.agreement import require_agreement  # noqa: E402
from scripts.export_hf import hf_config, to_hf  # noqa: E402
from trainer.config.schema import from_dict  # noqa: E402
from trainer.data.tokenizer_spm import BOS_ID, EOS_ID  # noqa: E402


def model_args(name: str, seq_len: int) -> ModelArgs:
    """Dimensions from conf/model/{name}.yaml, through the trainer's own config checks."""
    raw = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml"))
    return from_dict({"model": raw, "seq_len": seq_len}).model


def build_pair(args: ModelArgs, seed: int) -> tuple[nn.Module, nn.Module]:
    ours = Transformer(args)
    init_weights(ours, args, seed)
    # sdpa on both sides: the comparison is of the models around attention, not of attention kernels.
    config = LlamaConfig(**hf_config(args, "float32", BOS_ID, EOS_ID), attn_implementation="sdpa", use_cache=False)
    hf = LlamaForCausalLM(config)
    hf.load_state_dict({n: t.detach().clone() for n, t in to_hf(ours.state_dict(), ours.args).items()}, strict=True)
    return ours.train(), hf.train()


def make_step(model: nn.Module, logits_of: Callable[[torch.Tensor], torch.Tensor]) -> Callable:
    """Returns step(tokens, targets) -> (loss, seconds); the optimizer lives in the closure."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> tuple[float, float]:
        start = time.perf_counter()
        logits = logits_of(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), time.perf_counter() - start

    return step


def run(args: ModelArgs, batch: int, warmup: int, steps: int, seed: int) -> dict:
    ours, hf = build_pair(args, seed)
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, args.vocab_size, (batch, args.max_seq_len + 1), generator=gen)
    tokens, targets = data[:, :-1], data[:, 1:]
    step_ours = make_step(ours, ours)
    step_hf = make_step(hf, lambda t: hf(input_ids=t).logits)
    times_ours, times_hf, first_losses = [], [], None
    for i in range(warmup + steps):
        if i % 2 == 0:
            loss_ours, t_ours = step_ours(tokens, targets)
            loss_hf, t_hf = step_hf(tokens, targets)
        else:
            loss_hf, t_hf = step_hf(tokens, targets)
            loss_ours, t_ours = step_ours(tokens, targets)
        if i == 0:
            first_losses = (loss_ours, loss_hf)
        if i >= warmup:
            times_ours.append(t_ours)
            times_hf.append(t_hf)
    return {"ours": times_ours, "hf": times_hf, "losses": first_losses}


def table(name: str, tokens_per_step: int, result: dict) -> str:
    tps_ours = tokens_per_step / statistics.median(result["ours"])
    tps_hf = tokens_per_step / statistics.median(result["hf"])
    ratio = statistics.median(o / h for o, h in zip(result["ours"], result["hf"]))
    loss_ours, loss_hf = result["losses"]
    return "\n".join([
        "| model | tokens/s ours | tokens/s HF | step time ours/HF (median) | step-1 loss ours | step-1 loss abs diff |",
        "|---|---:|---:|---:|---:|---:|",
        f"| {name} | {tps_ours:,.0f} | {tps_hf:,.0f} | {ratio:.3f} | {loss_ours:.6f} | {abs(loss_ours - loss_hf):.2e} |",
    ])


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
    print(table(opts.model, opts.batch * opts.seq, result))
    loss_ours, loss_hf = result["losses"]
    print("\n" + require_agreement("step-1 losses of ours and HF", abs(loss_ours - loss_hf) / abs(loss_hf), rtol=1e-6))


if __name__ == "__main__":
    main()
