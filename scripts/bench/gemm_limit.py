"""What this process's matrix units can do at a training step's own GEMM shapes: the fp32 GEMM
throughput of every block linear's forward product and both backward products (input and weight
gradients) at the step's token count, FLOP-weighted (total FLOPs over total time). A step can go no
faster than its GEMMs alone: model FLOPs / step time / this limit is the share of it a step reaches.
(Counted per block: the output head's GEMM is in the model FLOPs, at the same throughput.)
"""

import time

import torch

from model.args import ModelArgs


def block_gemm_shapes(args: ModelArgs, tokens: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of every GEMM of one block's linears in one training step: y = x W^T, dx = dy W, dW = dy^T x."""
    q, kv, hidden = args.n_heads * args.head_dim, args.n_kv_heads * args.head_dim, args.ffn_hidden_dim
    linears = [(args.dim, q + 2 * kv), (q, args.dim), (args.dim, 2 * hidden), (hidden, args.dim)]  # (in, out)
    return [shape for d_in, d_out in linears
            for shape in ((tokens, d_in, d_out), (tokens, d_out, d_in), (d_out, tokens, d_in))]


class GemmPass:
    """One timed pass over every block GEMM of a step (fp32), to run in turn with the steps it bounds, so
    the same machine noise hits both: FLOPs / a pass's seconds is the limit at that moment."""

    def __init__(self, args: ModelArgs, tokens: int):
        shapes = block_gemm_shapes(args, tokens)
        gen = torch.Generator().manual_seed(0)
        self.operands = [(torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)) for m, k, n in shapes]
        self.flops = sum(2.0 * m * k * n for m, k, n in shapes)

    def __call__(self) -> float:
        """Seconds of one pass: each GEMM timed on its own."""
        seconds = 0.0
        for a, b in self.operands:
            start = time.perf_counter()
            torch.mm(a, b)
            seconds += time.perf_counter() - start
        return seconds
