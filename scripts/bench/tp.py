"""Our Megatron tensor-parallel block against PyTorch DTensor tensor parallelism on the same block.

Why: our TP (parallel/tensor_parallel.py) is hand-written autograd functions around plain tensors;
DTensor's `parallelize_module` is the stock alternative. This measures what ours costs or saves on
one TransformerBlock, with and without sequence parallelism, and checks both compute the same thing.

What: one TransformerBlock, fp32, gloo ranks on CPU, 1 thread per rank, dims from
conf/model/{tiny,small}.yaml, input [batch, seq, dim] (seq-split under SP) requiring grad,
step = forward + `out.sum().backward()`.
  ours:    TransformerBlock built with TPContext(tp_group, sp), init_weights slices of the full weights.
  DTensor: the TP=1 block (its linears swapped for nn.Linear holding the same weights, which is what
           the parallel styles accept) under torchtitan's llama plan: q/k/v, gate/up ColwiseParallel,
           wo/w2 RowwiseParallel, PrepareModuleInput on attention/feed_forward (Shard(1) -> Replicate
           under SP, Replicate -> Replicate without, so q/k/v share one input DTensor and its gradient
           is reduced once), norms SequenceParallel under SP.
Both are first checked against the TP=1 block: output and input gradient (this rank's sequence chunk
under SP), max |diff| / max |reference|, max over ranks. Under SP the norm weights' gradients stay
partial sums on both sides (DTensor: Partial; ours: summed over TP later, by the FSDP gradient sync).

Timing: all configurations of one tp size live in the same processes and run interleaved by rounds
(each round: K steps of each, the order rotating per round). A step's time is the slowest rank's;
the ratio is the median over rounds of per-round median ratios ours/DTensor. Collectives per step:
ours from parallel.comm.LEDGER, DTensor's counted by a dispatch mode over the functional collectives
it issues, both in the ledger's byte convention (gathered output for all-gather, unreduced input for
reduce-scatter, the tensor for all-reduce).

    python scripts/bench/tp.py [--model tiny|small] [--tp 2 4] [--batch 2] [--seq 256] [--rounds 10]
                               [--steps-per-round 3] [--quick]

Ranks are spawned by the script itself (torch.multiprocessing, file store, no torchrun).
"""

import sys
from pathlib import Path

# Scripts run from a checkout without installing the package.
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,  # noqa: E402
                                               SequenceParallel, parallelize_module)
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from model.args import ModelArgs  # noqa: E402
from model.attention import RotaryEmbedding  # noqa: E402
from model.init import init_weights  # noqa: E402
from model.transformer import TransformerBlock  # noqa: E402
from parallel import comm  # noqa: E402
from parallel.tensor_parallel import TPContext, tp_local_slice  # noqa: E402
from scripts.bench.agreement import require_agreement, worst  # noqa: E402
from scripts.bench.ranks import spawn  # noqa: E402
from trainer.config.schema import from_dict  # noqa: E402

SEED = 0
LINEARS = ("attention.wqkv", "attention.wo", "feed_forward.w13", "feed_forward.w2")
_FUNCOL = torch.ops._c10d_functional  # what DTensor's redistributions lower to
FUNCOL_OPS = {_FUNCOL.all_reduce.default: "all_reduce", _FUNCOL.all_gather_into_tensor.default: "all_gather",
              _FUNCOL.reduce_scatter_tensor.default: "reduce_scatter"}


@dataclass(frozen=True)
class Config:
    kind: str  # "ours" | "dtensor"
    sp: bool


CONFIGS = tuple(Config(kind, sp) for sp in (False, True) for kind in ("ours", "dtensor"))


def model_args(name: str, seq_len: int) -> ModelArgs:
    """Dimensions from conf/model/{name}.yaml, through the trainer's own config checks."""
    raw = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{name}.yaml"))
    return from_dict({"model": raw, "seq_len": seq_len}).model


# --- the blocks ----------------------------------------------------------------------------------
def plain_block(args: ModelArgs) -> TransformerBlock:
    """The TP=1 block with the full weights, the reference of both sides."""
    block = TransformerBlock(0, args, TPContext())
    init_weights(block, args, SEED)
    return block


def ours(args: ModelArgs, group: dist.ProcessGroup, sp: bool) -> TransformerBlock:
    tp = TPContext(group, sp)
    block = TransformerBlock(0, args, tp)
    init_weights(block, args, SEED, tp)
    return block


class FusedLinear(nn.Linear):
    """nn.Linear (the type the parallel styles take) standing in for our fused q/k/v or gate/up layer.

    Its rows are laid out rank by rank ([q_0; k_0; v_0; q_1; ...]) so that DTensor's contiguous row
    sharding hands every rank the same parts our layer holds; `split` is our layer's."""

    def __init__(self, weight: torch.Tensor, tp_size: int) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias=False)
        parts = weight.tp_parts
        self.local_sizes = [p // tp_size for p in parts]
        ranks = [tp_local_slice(weight.detach(), weight, TPContext(size=tp_size, rank=r)) for r in range(tp_size)]
        self.weight = nn.Parameter(torch.cat(ranks))

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split(self.local_sizes, dim=-1)


def with_nn_linears(block: TransformerBlock, tp_size: int) -> TransformerBlock:
    """Swap our TP=1 linears (plain `F.linear(x, weight)`) for nn.Linear, the type the parallel styles take."""
    for name in LINEARS:
        parent, _, child = name.rpartition(".")
        weight = block.get_submodule(name).weight
        if getattr(weight, "tp_parts", None):
            linear = FusedLinear(weight, tp_size)
        else:
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            linear.weight = weight
        setattr(block.get_submodule(parent), child, linear)
    return block


def dtensor_plan(sp: bool) -> dict[str, Any]:
    """torchtitan's llama block plan; without SP the activations between regions are replicated."""
    between = Shard(1) if sp else Replicate()
    plan: dict[str, Any] = {
        # One layout per positional input of Attention.forward: x, cos, sin, documents.
        "attention": PrepareModuleInput(input_layouts=(between, None, None, None),
                                        desired_input_layouts=(Replicate(), None, None, None)),
        # Attention views q/k/v as [batch, seq, local heads, head_dim]: plain local outputs (the default).
        "attention.wqkv": ColwiseParallel(use_local_output=True),
        "attention.wo": RowwiseParallel(output_layouts=between),
        "feed_forward": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
        "feed_forward.w13": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=between),
    }
    if sp:
        plan.update(attention_norm=SequenceParallel(), ffn_norm=SequenceParallel())
    return plan


def dtensor(args: ModelArgs, mesh: DeviceMesh, sp: bool) -> TransformerBlock:
    return parallelize_module(with_nn_linears(plain_block(args), mesh.size()), mesh, dtensor_plan(sp))


def build(cfg: Config, args: ModelArgs, mesh: DeviceMesh) -> TransformerBlock:
    return ours(args, mesh.get_group(), cfg.sp) if cfg.kind == "ours" else dtensor(args, mesh, cfg.sp)


# --- inputs, steps, collectives ------------------------------------------------------------------
@dataclass
class Inputs:
    full: torch.Tensor  # [batch, seq, dim], the same on every rank
    cos: torch.Tensor
    sin: torch.Tensor

    def local(self, t: torch.Tensor, sp: bool) -> torch.Tensor:
        """This rank's part of a [batch, seq, dim] tensor: its sequence chunk under SP, else all of it."""
        return t.chunk(dist.get_world_size(), dim=1)[dist.get_rank()].contiguous() if sp else t


def make_inputs(args: ModelArgs, batch: int) -> Inputs:
    full = torch.randn(batch, args.max_seq_len, args.dim, generator=torch.Generator().manual_seed(SEED))
    cos, sin = RotaryEmbedding(args.head_dim, args.rope_theta)(torch.arange(args.max_seq_len), full.dtype)
    return Inputs(full, cos, sin)


def forward_backward(block: nn.Module, x: torch.Tensor, inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, input gradient) of one step; parameter gradients are dropped."""
    x = x.detach().requires_grad_()
    out = block(x, inputs.cos, inputs.sin)
    out.sum().backward()
    block.zero_grad(set_to_none=True)
    return out.detach(), x.grad


def rel_diff(value: torch.Tensor, ref: torch.Tensor) -> float:
    return ((value - ref).abs().max() / ref.abs().max()).item()


def against_tp1(cfg: Config, block: nn.Module, inputs: Inputs, ref_out: torch.Tensor, ref_grad: torch.Tensor
                ) -> tuple[float, float]:
    """Relative diffs of this rank's output and input gradient from the TP=1 block's."""
    out, grad = forward_backward(block, inputs.local(inputs.full, cfg.sp), inputs)
    return rel_diff(out, inputs.local(ref_out, cfg.sp)), rel_diff(grad, inputs.local(ref_grad, cfg.sp))


class FuncolLedger(TorchDispatchMode):
    """Records the functional collectives DTensor issues into a CommLedger, in the ledger's byte convention."""

    def __init__(self) -> None:
        super().__init__()
        self.ledger = comm.CommLedger()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # let DTensor lower itself to plain ops and collectives first
        out = func(*args, **(kwargs or {}))
        op = FUNCOL_OPS.get(func)
        if op is not None:
            counted = out if op == "all_gather" else args[0]
            self.ledger.record(op, None, counted.numel() * counted.element_size())
        return out


def collectives(cfg: Config, block: nn.Module, inputs: Inputs) -> dict[str, dict[str, int]]:
    """{op: {count, bytes}} of one step."""
    x = inputs.local(inputs.full, cfg.sp)
    if cfg.kind == "ours":
        comm.LEDGER.reset()
        forward_backward(block, x, inputs)
        return comm.LEDGER.by_op()
    with FuncolLedger() as mode:
        forward_backward(block, x, inputs)
    return mode.ledger.by_op()


def timed_step(block: nn.Module, x: torch.Tensor, inputs: Inputs) -> float:
    """Seconds of one step on this rank, ranks aligned by a barrier outside the timing."""
    comm.barrier(comm.world())
    start = time.perf_counter()
    forward_backward(block, x, inputs)
    return time.perf_counter() - start


def interleaved(blocks: dict[Config, nn.Module], inputs: Inputs, warmup: int, rounds: int, k: int
                ) -> dict[Config, list[list[float]]]:
    """Per configuration and round, this rank's step times; round -1 is the untimed warmup."""
    times: dict[Config, list[list[float]]] = {cfg: [] for cfg in CONFIGS}
    for r in range(-1, rounds):
        shift = r % len(CONFIGS)
        for cfg in CONFIGS[shift:] + CONFIGS[:shift]:
            x = inputs.local(inputs.full, cfg.sp)
            steps = [timed_step(blocks[cfg], x, inputs) for _ in range(warmup if r < 0 else k)]
            if r >= 0:
                times[cfg].append(steps)
    return times


# --- one tp size in one set of processes ---------------------------------------------------------
def run_rank(rank: int, world: int, args: ModelArgs, batch: int, warmup: int, rounds: int, k: int) -> dict:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    comm.register_groups({mesh.get_group(): "tp"})
    inputs = make_inputs(args, batch)
    ref_out, ref_grad = forward_backward(plain_block(args), inputs.full, inputs)
    blocks = {cfg: build(cfg, args, mesh) for cfg in CONFIGS}
    diffs = {cfg: against_tp1(cfg, block, inputs, ref_out, ref_grad) for cfg, block in blocks.items()}
    comms = {cfg: collectives(cfg, block, inputs) for cfg, block in blocks.items()}
    times = interleaved(blocks, inputs, warmup, rounds, k)
    gathered = comm.all_gather_object((times, diffs), comm.world())
    return {"times": slowest_rank([t for t, _ in gathered]), "comm": comms,
            "diffs": {cfg: tuple(map(worst, zip(*(d[cfg] for _, d in gathered)))) for cfg in CONFIGS}}


def slowest_rank(per_rank: list[dict[Config, list[list[float]]]]) -> dict[Config, list[list[float]]]:
    """Per configuration, round and step: the max over ranks."""
    return {cfg: [[max(ts) for ts in zip(*rounds)] for rounds in zip(*(t[cfg] for t in per_rank))]
            for cfg in CONFIGS}


# --- report --------------------------------------------------------------------------------------
def median_ms(rounds: list[list[float]]) -> float:
    return statistics.median(t for rnd in rounds for t in rnd) * 1e3


def ratio(ours_rounds: list[list[float]], ref_rounds: list[list[float]]) -> float:
    return statistics.median(statistics.median(a) / statistics.median(b) for a, b in zip(ours_rounds, ref_rounds))


def comm_cell(ops: dict[str, dict[str, int]]) -> str:
    short = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR"}
    counts = ", ".join(f"{short.get(op, op)} {v['count']}" for op, v in ops.items()) or "none"
    return f"{counts} ({sum(v['bytes'] for v in ops.values()) / 2**20:.2f} MiB)"


def table(results: dict[int, dict]) -> str:
    lines = ["| tp | SP | ours ms | DTensor ms | ours/DTensor | ours collectives/step | DTensor collectives/step |",
             "|---:|---|---:|---:|---:|---|---|"]
    for tp, res in results.items():
        for sp in (False, True):
            mine, theirs = Config("ours", sp), Config("dtensor", sp)
            t = res["times"]
            lines.append(f"| {tp} | {sp} | {median_ms(t[mine]):.1f} | {median_ms(t[theirs]):.1f} "
                         f"| {ratio(t[mine], t[theirs]):.3f} | {comm_cell(res['comm'][mine])} "
                         f"| {comm_cell(res['comm'][theirs])} |")
    return "\n".join(lines)


def diff_table(results: dict[int, dict]) -> str:
    lines = ["| tp | SP | output ours | output DTensor | input grad ours | input grad DTensor |",
             "|---:|---|---:|---:|---:|---:|"]
    for tp, res in results.items():
        for sp in (False, True):
            (o_out, o_grad), (d_out, d_grad) = res["diffs"][Config("ours", sp)], res["diffs"][Config("dtensor", sp)]
            lines.append(f"| {tp} | {sp} | {o_out:.2e} | {d_out:.2e} | {o_grad:.2e} | {d_grad:.2e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "small"), default="small")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per configuration")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps-per-round", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 warmup step, 2 rounds of 1 step")
    opts = parser.parse_args(argv)
    if opts.quick:
        opts.warmup, opts.rounds, opts.steps_per_round = 1, 2, 1
    args = model_args(opts.model, opts.seq)
    for tp in opts.tp:
        if args.n_kv_heads % tp or opts.seq % tp:
            parser.error(f"tp={tp} must divide n_kv_heads={args.n_kv_heads} ({opts.model}) and --seq {opts.seq}")
    results = {tp: spawn(tp, run_rank, args, opts.batch, opts.warmup, opts.rounds, opts.steps_per_round)
               for tp in opts.tp}
    print(f"model {opts.model}, one TransformerBlock, batch {opts.batch} x seq {opts.seq}, fp32, gloo ranks on CPU "
          f"({os.cpu_count()} cores), 1 thread each; forward + backward of out.sum(); {opts.rounds} rounds x "
          f"{opts.steps_per_round} steps per configuration after {opts.warmup} warmup; torch {torch.__version__}\n")
    if max(opts.tp) > (os.cpu_count() or 1):
        print(f"tp > {os.cpu_count()} cores: those ranks share cores, so their times include time-slicing.\n")
    print(table(results))
    print("\nmax |x - x_tp1| / max |x_tp1| against the TP=1 block (this rank's sequence chunk under SP):\n")
    print(diff_table(results))
    diffs = [d for res in results.values() for per_config in res["diffs"].values() for d in per_config]
    print("\n" + require_agreement("outputs and input gradients of ours and DTensor against TP=1", worst(diffs),
                                    rtol=1e-5))


if __name__ == "__main__":
    main()
