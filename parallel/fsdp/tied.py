"""A weight tied across pipeline chunks: each chunk that uses it holds a copy, kept bitwise equal.

Tied embeddings use one weight on the first stage (the embedding) and on the last (the output head).
Where one chunk holds both uses, one unit holds the weight once and its gather spans the whole chunk
(fully_shard's `spans`). Where they are in different chunks, maybe on different ranks, each chunk holds
a copy, initialized alike, and, as in Megatron, the copies' gradients are summed after the step's
gradient reduction, before the norm and the optimizer (`sum_tied_grads`): every copy then takes the same
update, so they stay equal to the bit.

The sum is elementwise over shards, so every unit holding a copy lays it out alike: the copy first in
its flat parameter, and the unit padded to the same number of elements (`TiedCopy.unit_numel`); shard
rank r then holds the same elements of the weight in each of them. Norms count the weight once, on the
holder of the parameter named as the weight; checkpoints store it once, under that name, and every copy
loads from it. So a rank holds at most one copy of a weight: two would share one checkpoint entry.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.distributed import ProcessGroup, ReduceOp

from parallel import comm

if TYPE_CHECKING:
    from parallel.fsdp.root import FSDPRoot
    from parallel.fsdp.unit import FSDPUnit


@dataclass(frozen=True)
class TiedCopy:
    """A chunk's copy of a tied weight."""

    param: str  # the parameter holding it, by its full name in the model
    weight: str  # the weight's name: the parameter of this name counts in norms and is what checkpoints store
    unit_numel: int  # elements every unit holding a copy is padded to

    @property
    def counted(self) -> bool:
        return self.param == self.weight


def aliases(unit: FSDPUnit) -> dict[str, str]:
    """{parameter of the unit: the weight it is stored (and imported) under}: a copy other than the counted one."""
    if unit.tied is None or unit.tied.counted:
        return {}
    return {unit.tied.param.removeprefix(f"{unit.name}."): unit.tied.weight}


def _copy_pieces(roots: list[FSDPRoot], tensor_of: Callable[[FSDPUnit], torch.Tensor]) -> list[torch.Tensor]:
    """Per tied weight (by name), this rank's piece of its copy: the part of `tensor_of(unit)` (the shard or
    its gradient) that holds the copy, elements [0, numel) of the flat parameter. Every unit holding a copy
    of one weight has the same shard size, so the pieces are the same elements of the weight."""
    pieces: dict[str, torch.Tensor] = {}
    for unit in (u for root in roots for u in root.units if u.tied is not None):
        if unit.tied.weight in pieces:
            raise ValueError(f"two copies of the tied weight {unit.tied.weight} on one rank: they would be loaded "
                             "from one checkpoint entry into one of them only")
        held = min(unit.spec.shard_size, unit.spec.numels[0] - unit.rank * unit.spec.shard_size)
        pieces[unit.tied.weight] = tensor_of(unit)[: max(held, 0)]
    return [pieces[weight] for weight in sorted(pieces)]


@torch.no_grad()
def sum_tied_grads(roots: list[FSDPRoot], group: ProcessGroup | None) -> None:
    """Every copy's gradient becomes the sum of all copies' gradients (one all-reduce over `group`, the
    ranks holding the copies, per tied weight): after finish_gradient_sync, before the norm."""
    for piece in _copy_pieces(roots, lambda unit: unit.flat_param.grad):
        if comm.size_of(group) > 1 and piece.numel():
            comm.all_reduce(piece, group, label="tied weights")


@torch.no_grad()
def tied_copies_equal(roots: list[FSDPRoot], group: ProcessGroup | None, world: ProcessGroup) -> bool:
    """Whether every copy of every tied weight holds the same bits, on every rank of `world`, which all call
    this together: one all-reduce (max of the bits) over `group` per tied weight, and one over `world`."""
    differ = torch.zeros(1, device=roots[0].units[0].flat_param.device)  # NCCL reduces device tensors only
    for piece in _copy_pieces(roots, lambda unit: unit.flat_param.detach()):
        bits = piece.view(torch.int32)
        top = bits.clone()
        if comm.size_of(group) > 1 and top.numel():
            comm.all_reduce(top, group, op=ReduceOp.MAX, label="tied weights")
        differ += not torch.equal(bits, top)  # every copy equals the elementwise max iff all are equal
    if comm.size_of(world) > 1:
        comm.all_reduce(differ, world, label="tied weights equal")
    return differ.item() == 0
