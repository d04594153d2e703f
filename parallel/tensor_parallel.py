"""Megatron tensor parallelism with sequence parallelism, as explicit autograd functions.

Regions (tp = the tensor-parallel group; seq is dim 1 of [batch, seq, hidden] activations):

    copy_to_tp       forward identity,            backward all-reduce      (input of column-parallel, no SP)
    reduce_from_tp   forward all-reduce,          backward identity        (output of row-parallel, no SP)
    gather_from_sp   forward all-gather seq,      backward reduce-scatter  (input of column-parallel, SP)
    scatter_to_sp    forward reduce-scatter seq,  backward all-gather      (output of row-parallel, SP)

Column-parallel linears own a slice of the output features, row-parallel ones a slice of the input
features; a block therefore communicates twice forward and twice backward. Every collective goes
through parallel/comm.py.
"""

import torch
from torch import nn
from torch.distributed import ProcessGroup

from parallel import comm, weight_grads
from parallel.regional_compile import eager_region

SEQ_DIM = 1


def _all_reduce(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Sum into a new tensor: a Function must not modify its input in place."""
    out = x.clone(memory_format=torch.contiguous_format)
    comm.all_reduce(out, group)
    return out


def _all_gather_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[b, s/tp, h] -> [b, s, h]: gather along seq (done on a seq-major copy, as collectives need dim 0)."""
    world = group.size()
    local = x.transpose(0, SEQ_DIM).contiguous()
    out = torch.empty((local.shape[0] * world, *local.shape[1:]), dtype=x.dtype, device=x.device)
    comm.all_gather_into_tensor(out, local, group)
    return out.transpose(0, SEQ_DIM).contiguous()


def _reduce_scatter_seq(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[b, s, h] partial sums -> [b, s/tp, h] of the summed tensor."""
    world = group.size()
    full = x.transpose(0, SEQ_DIM).contiguous()
    out = torch.empty((full.shape[0] // world, *full.shape[1:]), dtype=x.dtype, device=x.device)
    comm.reduce_scatter_tensor(out, full, group)
    return out.transpose(0, SEQ_DIM).contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_seq(grad, ctx.group), None


class _ScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_seq(grad, ctx.group), None


@eager_region
def copy_to_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _CopyToTP.apply(x, group) if group.size() > 1 else x


@eager_region
def reduce_from_tp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _ReduceFromTP.apply(x, group) if group.size() > 1 else x


@eager_region
def gather_from_sp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _GatherFromSP.apply(x, group) if group.size() > 1 else x


@eager_region
def scatter_to_sp(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    return _ScatterToSP.apply(x, group) if group.size() > 1 else x


class TPContext:
    """The TP group and whether activations between TP regions are sequence-split.

    Offline tools (export, shape inspection) build one with a size and rank but no group.
    """

    def __init__(self, group: ProcessGroup | None = None, sequence_parallel: bool = False,
                 size: int | None = None, rank: int | None = None):
        self.group = group
        self.size = size if size is not None else comm.size_of(group)
        self.rank = rank if rank is not None else comm.rank_in(group)
        self.sequence_parallel = sequence_parallel and self.size > 1

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a column-parallel region: the full sequence, replicated."""
        if self.size == 1:
            return x
        return gather_from_sp(x, self.group) if self.sequence_parallel else copy_to_tp(x, self.group)

    def exit(self, partial_sum: torch.Tensor) -> torch.Tensor:
        """Out of a row-parallel region: sum the partial results (seq-split under SP)."""
        if self.size == 1:
            return partial_sum
        return scatter_to_sp(partial_sum, self.group) if self.sequence_parallel else reduce_from_tp(partial_sum, self.group)

    def local_size(self, size: int, what: str) -> int:
        """This rank's share of a dimension that splits evenly over TP (validate refuses the configs that
        do not; a remainder would silently belong to no rank)."""
        if size % self.size:
            raise ValueError(f"{what}={size} does not split over tensor parallelism of size {self.size}")
        return size // self.size


def mark_tp_dim(param: nn.Parameter, dim: int | None, parts: tuple[int, ...] | None = None) -> nn.Parameter:
    """Record which dim of a parameter is split over TP (None: replicated) and, for a fused parameter,
    the full sizes of its parts along that dim (each part is split separately); init and export read it."""
    param.tp_dim = dim
    param.tp_parts = parts
    return param


def tp_local_slice(full: torch.Tensor, param: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """This TP rank's slice of a parameter's full value: part by part for fused parameters."""
    dim = getattr(param, "tp_dim", None)
    if dim is None:
        return full
    parts = getattr(param, "tp_parts", None) or (full.shape[dim],)
    return torch.cat([p.chunk(tp.size, dim)[tp.rank] for p in full.split(parts, dim)], dim).contiguous()


def tp_merge(slices: list[torch.Tensor], param: torch.Tensor) -> torch.Tensor:
    """The full value from every TP rank's slice (in rank order): the inverse of tp_local_slice."""
    dim = getattr(param, "tp_dim", None)
    if dim is None:
        return slices[0]
    parts = getattr(param, "tp_parts", None) or (param.shape[dim] * len(slices),)
    local_sizes = [p // len(slices) for p in parts]
    per_rank = [s.split(local_sizes, dim) for s in slices]
    return torch.cat([torch.cat([rank_parts[i] for rank_parts in per_rank], dim) for i in range(len(parts))], dim)


def matmul(x: torch.Tensor, weight: torch.Tensor, gemm: nn.Module | None) -> torch.Tensor:
    """x @ weight^T: a plain matmul (its weight gradient deferred in a zero-bubble step), or the linear's
    own `gemm(x, weight)` (e.g. an fp8 one)."""
    return weight_grads.linear(x, weight) if gemm is None else gemm(x, weight)


class ColumnParallelLinear(nn.Module):
    """y[..., out/tp] = x @ W_local^T, W_local = rows [rank*out/tp, (rank+1)*out/tp) of the full W.

    Several outputs can be fused into one matmul (q/k/v, gate/up): each part is split over TP on its
    own, so a rank holds [part0_r; part1_r; ...] (for GQA: whole query heads and the KV heads they share).
    """

    def __init__(self, in_features: int, out_features: int | tuple[int, ...], tp: TPContext,
                 gemm: nn.Module | None = None):
        super().__init__()
        self.tp, self.gemm = tp, gemm
        parts = out_features if isinstance(out_features, tuple) else (out_features,)
        self.local_sizes = [tp.local_size(p, "out_features") for p in parts]
        weight = nn.Parameter(torch.empty(sum(self.local_sizes), in_features))
        self.weight = mark_tp_dim(weight, 0, parts if len(parts) > 1 else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x must already be in the TP region (TPContext.enter), so several linears can share one entry."""
        return matmul(x, self.weight, self.gemm)

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The fused output's parts (this rank's share of each)."""
        return y.split(self.local_sizes, dim=-1)


class RowParallelLinear(nn.Module):
    """Partial y = x[..., in/tp] @ W_local^T, W_local = columns [rank*in/tp, ...) of the full W."""

    def __init__(self, in_features: int, out_features: int, tp: TPContext, gemm: nn.Module | None = None):
        super().__init__()
        self.tp, self.gemm = tp, gemm
        self.weight = mark_tp_dim(nn.Parameter(torch.empty(out_features, tp.local_size(in_features, "in_features"))), 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.exit(matmul(x, self.weight, self.gemm))


class VocabParallelEmbedding(nn.Module):
    """Each TP rank holds rows [rank*V/tp, (rank+1)*V/tp) of the table; out-of-range tokens give zeros
    and the partial embeddings are summed on the way out of the region (seq-split under SP)."""

    def __init__(self, vocab_size: int, dim: int, tp: TPContext):
        super().__init__()
        self.tp = tp
        local = tp.local_size(vocab_size, "vocab_size")
        self.vocab_start = tp.rank * local
        self.weight = mark_tp_dim(nn.Parameter(torch.empty(local, dim)), 0)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return nn.functional.embedding(tokens, self.weight)
        local = tokens - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.exit(out.masked_fill(outside.unsqueeze(-1), 0.0))
