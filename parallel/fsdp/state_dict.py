"""FSDP shards as full, named parameters for torch.distributed.checkpoint.

A checkpoint stores every parameter (and every tensor shaped like one, e.g. Adam moments) under its
full name at its full, TP-merged shape. A rank's shard of a flat parameter is a contiguous range of
the concatenated TP-local parameters; each parameter's part of that range splits into a few boxes
(a partial first row, whole rows, a partial last row), and each box sits at a known offset of the
full parameter (TP rank r's slice of a split dim starts at r x the local size, part by part for fused
parameters). DCP records every box at its offset, so any other layout (tp, pp, dp, cp) reads back the
boxes it owns, wherever they were written. No collective is needed to describe the layout: every
rank derives its boxes from the flat spec, its shard rank and its TP rank. The same boxes let a rank
build its initial shard from the full parameters' values without the rest of them (`fill_shard`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from parallel.fsdp.flat_param import FlatParamSpec


@dataclass(frozen=True)
class TPSplit:
    """How a parameter is split over TP: the dim (None: replicated) and, for a fused parameter, the full
    sizes of its parts along that dim (each part split on its own)."""

    dim: int | None = None
    parts: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Box:
    """A rectangular piece of a full parameter, stored contiguously in a rank's shard from `start`."""

    offsets: tuple[int, ...]  # in the full parameter
    sizes: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_range_boxes(shape: tuple[int, ...], lo: int, hi: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [lo, hi) of a row-major tensor of `shape` as (offsets, sizes) boxes, in storage order;
    each box is contiguous in storage."""
    if lo >= hi:
        return []
    if len(shape) == 1:
        return [((lo,), (hi - lo,))]
    inner = math.prod(shape[1:])
    first, last = lo // inner, hi // inner
    if first == last:  # inside one row
        return [((first, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo - first * inner, hi - first * inner)]
    boxes = []
    if lo % inner:
        boxes += [((first, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], lo % inner, inner)]
        first += 1
    if last > first:
        boxes.append(((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:])))
    if hi % inner:
        boxes += [((last, *o), (1, *s)) for o, s in flat_range_boxes(shape[1:], 0, hi % inner)]
    return boxes


def _to_full(offsets: tuple[int, ...], sizes: tuple[int, ...], local_shape: tuple[int, ...], split: TPSplit,
             tp_rank: int, tp_size: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """A box of the TP-local parameter as boxes of the full one: (offsets, sizes, first element's index
    within the local box), split at fused-part boundaries."""
    d = split.dim
    if d is None or tp_size == 1:
        return [(offsets, sizes, 0)]
    local_parts = [p // tp_size for p in split.parts] if split.parts else [local_shape[d]]
    full_parts = list(split.parts) if split.parts else [local_shape[d] * tp_size]
    if len(local_parts) > 1 and d != 0:
        raise ValueError(f"fused parameters split over TP along dim {d}: only dim 0 is supported")
    inner = math.prod(sizes[d + 1:]) if d == 0 else 0
    out, local_start, full_start = [], 0, 0
    for local, full in zip(local_parts, full_parts):
        lo, hi = max(offsets[d], local_start), min(offsets[d] + sizes[d], local_start + local)
        if lo < hi:
            o, s = list(offsets), list(sizes)
            o[d], s[d] = full_start + tp_rank * local + (lo - local_start), hi - lo
            out.append((tuple(o), tuple(s), (lo - offsets[d]) * inner))
        local_start, full_start = local_start + local, full_start + full
    return out


def full_shape(local_shape: tuple[int, ...], split: TPSplit, tp_size: int) -> tuple[int, ...]:
    if split.dim is None:
        return tuple(local_shape)
    shape = list(local_shape)
    shape[split.dim] *= tp_size
    return tuple(shape)


def shard_boxes(spec: FlatParamSpec, shard_rank: int, splits: tuple[TPSplit, ...], tp_rank: int,
                tp_size: int) -> dict[str, list[Box]]:
    """{parameter name: the boxes of the full parameter held in this rank's shard} (names relative to the
    unit; parameters with no element in the shard are absent)."""
    begin = shard_rank * spec.shard_size
    end = begin + spec.valid_in_shard(shard_rank)
    boxes: dict[str, list[Box]] = {}
    for name, shape, offset, split in zip(spec.names, spec.shapes, spec.offsets(), splits):
        lo, hi = max(begin, offset) - offset, min(end, offset + math.prod(shape)) - offset
        start = offset + lo - begin  # where element lo of the parameter sits in the shard
        for local_offsets, sizes in flat_range_boxes(tuple(shape), lo, hi):
            for offsets, full_sizes, skip in _to_full(local_offsets, sizes, tuple(shape), split, tp_rank, tp_size):
                boxes.setdefault(name, []).append(Box(offsets, full_sizes, start + skip))
            start += math.prod(sizes)
    return boxes


BoxValue = Callable[[str, tuple[int, ...], tuple[int, ...], tuple[int, ...]], torch.Tensor]


def fill_shard(shard: torch.Tensor, spec: FlatParamSpec, shard_rank: int, splits: tuple[TPSplit, ...], tp_rank: int,
               tp_size: int, box_value: BoxValue) -> torch.Tensor:
    """Write every box of this rank's shard from `box_value(name, full shape, offsets, sizes)`, the box of
    the full parameter's value: what a rank keeps, built without the rest of the (TP-local) parameter."""
    boxes = shard_boxes(spec, shard_rank, splits, tp_rank, tp_size)
    for name, shape, split in zip(spec.names, spec.shapes, splits):
        size = full_shape(tuple(shape), split, tp_size)
        for box in boxes.get(name, []):
            shard[box.start : box.start + box.numel] = box_value(name, size, box.offsets, box.sizes).reshape(-1)
    return shard


class BoxedParameter(torch.Tensor):
    """A full parameter as DCP sees it: its full shape, and this rank's boxes of it, views into a shard.

    DCP saves the boxes (`writes`: False on ranks whose copy another rank writes, e.g. TP-replicated
    parameters on TP ranks > 0) and loads into them; nothing else may be done with it."""

    @staticmethod
    def __new__(cls, size: tuple[int, ...], local: torch.Tensor, boxes: list[Box], writes: bool = True):
        self = torch.Tensor._make_wrapper_subclass(cls, size, dtype=local.dtype, device=local.device)
        self._views = {b.offsets: local[b.start : b.start + b.numel].view(b.sizes) for b in boxes}
        self._writes = writes
        return self

    def host_copy(self) -> BoxedParameter:
        """The same boxes, copied to host memory: what an asynchronous save writes while training goes on."""
        copy = BoxedParameter.__new__(BoxedParameter, tuple(self.shape), torch.empty(0, dtype=self.dtype), [],
                                      self._writes)
        copy._views = {offsets: view.detach().to("cpu", copy=True) for offsets, view in self._views.items()}
        return copy

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"BoxedParameter only carries shards for checkpoints; {func} is not supported")

    def __create_write_items__(self, fqn: str, obj: object) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        if not self._writes:
            return []
        return [
            WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                      tensor_data=TensorWriteData(
                          chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape),
                          properties=TensorProperties.create_from_tensor(view), size=self.shape))
            for offsets, view in self._views.items()
        ]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=v.shape) for o, v in self._views.items()]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self._views[tuple(index.offset)]

    def __repr__(self) -> str:
        return f"BoxedParameter(shape={tuple(self.shape)}, boxes={len(self._views)})"


def boxed_parameters(name: str, spec: FlatParamSpec, splits: tuple[TPSplit, ...], shard_rank: int, tp_rank: int,
                     tp_size: int, local: torch.Tensor,
                     aliases: dict[str, str] | None = None) -> dict[str, BoxedParameter]:
    """{full parameter name: its boxes in `local`} for a unit called `name`; `local` is the rank's shard
    of the flat parameter or a tensor shaped like it (an Adam moment). TP-replicated parameters are
    written by TP rank 0 only (the other TP ranks hold the same values, in differently cut boxes).
    `aliases`: {parameter: the name it goes under instead}, for a tied weight's copy (tied.py): loaded
    from that weight, never written (the weight's own holder writes it)."""
    boxes = shard_boxes(spec, shard_rank, splits, tp_rank, tp_size)
    aliases = aliases or {}
    out = {}
    for param, split, shape in zip(spec.names, splits, spec.shapes):
        if param in boxes:
            size = full_shape(tuple(shape), split, tp_size)
            writes = (split.dim is not None or tp_rank == 0) and param not in aliases
            out[aliases.get(param, f"{name}.{param}")] = BoxedParameter(size, local.detach(), boxes[param], writes)
    return out
