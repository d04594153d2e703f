"""Context parallelism side by side: one transformer block, forward + backward, C = 1, 2, 4.

Configs (all in the same 4 gloo CPU processes, interleaved by rounds so machine noise hits them alike;
a config with C < 4 runs on the first C ranks while the others wait at the barrier):
  C=1            the block on one rank, attention by torch's scaled_dot_product_attention
  C=2, C=4       the block on C ranks, each holding 1/C of the sequence (head-tail chunks), with
                 context_parallel_comm=all_gather and =ring
  SDPA core      the attention core alone: torch SDPA over the whole sequence on one rank, beside our
                 all_gather core on C ranks (what a user would otherwise run)

Per config: step time (the slowest rank's, median over rounds), activation bytes saved for backward
per rank (the block's saved tensors by storage), and the K/V bytes a rank holds at once during the
exchange (all_gather: the gathered K and V, from the ledger; ring: the block being computed on plus the
one arriving). fp32, 1 thread per rank.

    python scripts/bench/cp.py [--model small] [--seq 2048] [--rounds 3] [--quick]
"""

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402
from torch.autograd.graph import saved_tensors_hooks  # noqa: E402

from model.attention import RotaryEmbedding  # noqa: E402
from model.init import init_weights  # noqa: E402
from model.transformer import TransformerBlock  # noqa: E402
from parallel import comm  # noqa: E402
from parallel.context_parallel import CPContext, context_parallel_attention  # noqa: E402
from parallel.tensor_parallel import TPContext  # noqa: E402
from scripts.bench.ranks import spawn  # noqa: E402
from trainer.config.schema import from_dict  # noqa: E402

WORLD = 4


class SavedBytes:
    """Bytes autograd saves for backward, counted once per storage."""

    def __init__(self):
        self.storages: dict[int, int] = {}
        self.hooks = saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def block_step(block: TransformerBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    saved = SavedBytes()
    with saved.hooks:
        out = block(x, cos, sin)
    out.square().mean().backward()
    return saved.total


def core_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPContext | None) -> None:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    if cp is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:
        out = context_parallel_attention(q, k, v, cp)
    out.square().mean().backward()


def run(rank: int, world: int, model: str, seq: int, rounds: int) -> dict:
    raw = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / f"{model}.yaml"))
    args = from_dict({"model": raw, "seq_len": seq}).model
    groups = {1: None} | {c: dist.new_group(list(range(c))) for c in (2, 4)}
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, seq, args.dim, generator=gen)
    q = torch.randn(1, args.n_heads, seq, args.head_dim, generator=gen)
    k, v = (torch.randn(1, args.n_kv_heads, seq, args.head_dim, generator=gen) for _ in range(2))
    cos, sin = RotaryEmbedding(args.head_dim, args.rope_theta)(torch.arange(seq), torch.float32)
    configs = {"C=1": (1, "all_gather")} | {f"C={c} {mode}": (c, mode) for c in (2, 4) for mode in ("all_gather", "ring")}
    blocks = {}
    for name, (c, mode) in configs.items():
        if rank < c:
            cp = CPContext(groups[c], mode)
            blocks[name] = TransformerBlock(0, args, TPContext(), cp)
            init_weights(blocks[name], args, seed=0)
    cores = {"SDPA core": (1, None)} | {f"C={c} all_gather core": (c, CPContext(groups[c])) for c in (2, 4)}
    times: dict[str, list[float]] = {name: [] for name in (*configs, *cores)}
    saved, kv_held = {}, {}
    for round_ in range(rounds + 1):
        for name in times:
            c = configs[name][0] if name in configs else cores[name][0]
            comm.barrier(comm.world())
            start = time.perf_counter()
            if rank < c and name in configs:
                block, cp = blocks[name], blocks[name].attention.core.cp
                positions = cp.positions(seq // c, x.device)
                comm.LEDGER.reset()
                saved[name] = block_step(block, cp.shard(x), cos[positions], sin[positions])
                kv_held[name] = _kv_bytes_held(comm.LEDGER.by_op(), configs[name][1] if c > 1 else None)
            elif rank < c:
                cp = cores[name][1]
                core_step(*((cp or CPContext()).shard(t, dim=2) for t in (q, k, v)), cp)
            elapsed = torch.tensor([time.perf_counter() - start])
            comm.all_reduce(elapsed, comm.world(), op=dist.ReduceOp.MAX)
            if round_ > 0:  # the first round warms up
                times[name].append(elapsed.item())
    return {"time": {n: statistics.median(t) for n, t in times.items()}, "saved": saved, "kv": kv_held}


def _kv_bytes_held(ledger: dict, mode: str | None) -> int:
    """K/V bytes a rank holds at once in the forward's exchange."""
    if mode == "all_gather":
        return ledger["all_gather"]["bytes"] // ledger["all_gather"]["count"] * 2  # gathered K and V
    if mode == "ring":
        return 2 * ledger["recv"]["bytes"] // ledger["recv"]["count"]  # current block + the one arriving
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="model=tiny, seq 256, 2 rounds")
    opts = parser.parse_args()
    if opts.quick:
        opts.model, opts.seq, opts.rounds = "tiny", 256, 2
    result = spawn(WORLD, run, opts.model, opts.seq, opts.rounds)
    base = result["time"]["C=1"]
    print(f"one {opts.model} block, seq {opts.seq}, forward + backward, fp32, gloo CPU ranks:")
    print("| config | step ms | vs C=1 | saved for backward MiB/rank | K/V held in exchange MiB/rank |")
    print("|---|---:|---:|---:|---:|")
    for name in ("C=1", "C=2 all_gather", "C=2 ring", "C=4 all_gather", "C=4 ring"):
        t, kv = result["time"][name], result["kv"][name] / 2**20
        print(f"| {name} | {t * 1e3:.1f} | {t / base:.2f} | {result['saved'][name] / 2**20:.1f} | "
              f"{kv:.2f} |")
    sdpa = result["time"]["SDPA core"]
    print("\n| attention core | ms | vs SDPA on the whole sequence |\n|---|---:|---:|")
    print(f"| torch SDPA, 1 rank | {sdpa * 1e3:.1f} | 1.00 |")
    for c in (2, 4):
        t = result["time"][f"C={c} all_gather core"]
        print(f"| ours all_gather, C={c} | {t * 1e3:.1f} | {t / sdpa:.2f} |")
    for c in (2, 4):
        ratio = result["kv"][f"C={c} ring"] / result["kv"][f"C={c} all_gather"]
        print(f"C={c}: ring's K/V held / all_gather's = {ratio:.2f} (target <= {2 / c:.2f})")


if __name__ == "__main__":
    main()
