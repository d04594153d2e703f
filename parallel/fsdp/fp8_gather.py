"""fp8 all-gather of a unit's flat parameter: one byte per element for the weights of fp8 GEMMs.

A unit's flat shard mixes tensors: weights that an fp8 GEMM consumes (their owner's `gemm` is an
`Fp8WeightConsumer`) and parameters that stay in the compute dtype (norm weights). Each rank casts its
pieces of the fp8 weights with the weight's scale of the step (scales are identical on every rank:
the amax reduction spans the shard group) and all-gathers the shard's bytes as uint8 (gloo cannot
gather float8 tensors; their bytes are the same). The other parameters travel in a second, small
all-gather in the compute dtype: each rank sends its shard's elements of them, padded to the largest
such count of any rank, and the receivers put them back by a precomputed index.

After the gathers, each consumer takes its fp8 weight (a view of the gathered bytes) for its GEMMs
and the unit's compute-dtype buffer gets the dequantized values, so the module's parameter views
still hold the weights (what the GEMMs use, exactly) and their gradients flow as before. On CUDA
torch._scaled_mm reads those views in place, which needs each to start 16-byte aligned: the config
rules make every parameter's size a multiple of 16 elements, and `fp8_weight_view` asserts it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch.distributed import ProcessGroup

from parallel import comm
from parallel.fsdp.flat_param import FlatParamSpec, allocate_storage, free_storage


@runtime_checkable
class Fp8WeightConsumer(Protocol):
    """What a linear's GEMM offers to receive its weight in fp8."""

    @property
    def fp8_weight_dtype(self) -> torch.dtype: ...

    def record_weight_amax(self, piece: torch.Tensor) -> None:
        """Fold the amax of a piece of the weight into the amaxes the next scale update reads."""

    def cast_weight_shard(self, piece: torch.Tensor) -> torch.Tensor:
        """A piece of the weight (fp32) cast to fp8 with the step's scale; records its amax."""

    def use_gathered_weight(self, weight_fp8: torch.Tensor) -> torch.Tensor:
        """Take the whole gathered fp8 weight for the coming GEMMs; returns its dequantized value."""


@dataclass(frozen=True)
class Fp8Param:
    offset: int
    numel: int
    shape: torch.Size
    consumer: Fp8WeightConsumer


def _overlap(offset: int, numel: int, lo: int, hi: int) -> tuple[int, int] | None:
    start, end = max(offset, lo), min(offset + numel, hi)
    return (start, end) if start < end else None


def shard_pieces(fp8_params: list[Fp8Param], rank: int, shard_size: int) -> list[tuple[int, int, Fp8WeightConsumer]]:
    """(start, end, consumer) of each fp8 weight's piece in `rank`'s shard, relative to the shard."""
    lo = rank * shard_size
    return [(span[0] - lo, span[1] - lo, p.consumer)
            for p in fp8_params if (span := _overlap(p.offset, p.numel, lo, lo + shard_size))]


ALIGNMENT = 16  # bytes: where torch._scaled_mm's operands must start


def check_alignment(address: int, p: Fp8Param, label: str) -> None:
    """Raise if parameter `p`'s fp8 weight would start (at `address`) off a 16-byte boundary."""
    if address % ALIGNMENT:
        raise AssertionError(f"FSDP unit {label}: an fp8-gathered weight of shape {tuple(p.shape)} at byte "
                             f"{p.offset} of the gathered bytes is not {ALIGNMENT}-byte aligned (torch._scaled_mm "
                             f"reads it in place); every parameter's size must be a multiple of {ALIGNMENT} elements")


def fp8_weight_view(gathered: torch.Tensor, p: Fp8Param, label: str) -> torch.Tensor:
    """Parameter `p`'s fp8 weight, a view of the gathered bytes, checked to start 16-byte aligned."""
    view = gathered[p.offset : p.offset + p.numel].view(p.consumer.fp8_weight_dtype).view(p.shape)
    check_alignment(view.data_ptr(), p, label)
    return view


class Fp8Gather:
    def __init__(self, spec: FlatParamSpec, rank: int, group: ProcessGroup, compute_dtype: torch.dtype,
                 fp8_params: list[Fp8Param], label: str, device: torch.device):
        for p in fp8_params:  # at build: the gathered buffer is aligned, so each view starts at its offset's
            check_alignment(p.offset, p, label)
        self.spec, self.rank, self.group, self.label = spec, rank, group, label
        self.compute_dtype, self.fp8_params = compute_dtype, fp8_params
        size = spec.shard_size
        lo = rank * size
        self._my_fp8 = shard_pieces(fp8_params, rank, size)
        fp8_offsets = {p.offset for p in fp8_params}
        other = [(o, n) for o, n in zip(spec.offsets(), spec.numels) if o not in fp8_offsets]
        per_rank = [[s for o, n in other if (s := _overlap(o, n, r * size, (r + 1) * size))] for r in range(spec.world)]
        self._my_other = [(a - lo, b - lo) for a, b in per_rank[rank]]
        self.other_width = max(sum(b - a for a, b in spans) for spans in per_rank)
        src, dst = [], []
        for r, spans in enumerate(per_rank):
            pos = r * self.other_width
            for a, b in spans:
                dst.extend(range(a, b))
                src.extend(range(pos, pos + b - a))
                pos += b - a
        self._other_src = torch.tensor(src, dtype=torch.int64, device=device)
        self._other_dst = torch.tensor(dst, dtype=torch.int64, device=device)
        self.bytes = torch.empty(spec.padded, dtype=torch.uint8, device=device)
        free_storage(self.bytes)
        self._other: torch.Tensor | None = None

    def start(self, shard: torch.Tensor) -> list[tuple[comm.Pending, torch.Tensor]]:
        """Cast this rank's shard and start the gathers; returns (work, input kept alive) pairs."""
        cast = torch.zeros(self.spec.shard_size, dtype=torch.uint8, device=shard.device)
        for a, b, consumer in self._my_fp8:
            cast[a:b] = consumer.cast_weight_shard(shard[a:b]).view(torch.uint8)
        other = torch.zeros(self.other_width, dtype=self.compute_dtype, device=shard.device)
        if self._my_other:
            mine = torch.cat([shard[a:b] for a, b in self._my_other])
            other[: mine.numel()] = mine.to(self.compute_dtype)
        allocate_storage(self.bytes)
        self._other = torch.empty(self.other_width * self.spec.world, dtype=self.compute_dtype, device=shard.device)
        if self.spec.world == 1:
            self.bytes.copy_(cast)
            self._other.copy_(other)
            return []
        pending = [(comm.all_gather_into_tensor(self.bytes, cast, self.group, async_op=True, label=self.label), cast)]
        if self.other_width:
            work = comm.all_gather_into_tensor(self._other, other, self.group, async_op=True, label=self.label)
            pending.append((work, other))
        return pending

    def finish(self, buffer: torch.Tensor) -> None:
        """After the gathers landed: hand each consumer its fp8 weight, fill the compute buffer."""
        for p in self.fp8_params:
            weight_fp8 = fp8_weight_view(self.bytes, p, self.label)
            buffer[p.offset : p.offset + p.numel].copy_(p.consumer.use_gathered_weight(weight_fp8).reshape(-1))
        buffer[self._other_dst] = self._other[self._other_src]
        self._other = None

    def free(self) -> None:
        free_storage(self.bytes)


def fp8_params_of(spec: FlatParamSpec, owners: list[tuple[torch.nn.Module, str]]) -> list[Fp8Param]:
    """The unit's parameters that an fp8 GEMM consumes: `weight`s whose owner's `gemm` is a consumer."""
    return [
        Fp8Param(offset, numel, shape, sub.gemm)
        for (sub, attr), offset, numel, shape in zip(owners, spec.offsets(), spec.numels, spec.shapes)
        if attr == "weight" and isinstance(getattr(sub, "gemm", None), Fp8WeightConsumer)
    ]
