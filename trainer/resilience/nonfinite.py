"""What a step does with a NaN or Inf loss or gradient norm (`nan_policy`), and where it came from.

Every rank holds the same reduced loss and gradient norm, so all ranks take the same branch: `halt`
(default) stops before the update with one line naming the step and the first unit (in model order)
whose gradient is not finite; `skip` leaves the weights and optimizer state untouched for that step and
counts it. Finding the unit costs one exchange of small messages, on the failure path only.
"""

import math

import torch
from torch.distributed import ProcessGroup

from parallel import comm
from parallel.fsdp import FSDPRoot


def first_nonfinite_unit(roots: list[FSDPRoot], stages: list[int]) -> str | None:
    """The first unit in model order, over all ranks, whose gradient holds a NaN or Inf (every rank
    must call this together); `stages[c]` is the pipeline stage of `roots[c]`, increasing in c."""
    mine = None
    for chunk, root in enumerate(roots):
        for index, unit in enumerate(root.units):
            grad = unit.flat_param.grad
            if grad is not None and not torch.isfinite(grad).all():
                mine = (stages[chunk], index, unit.name)
                break
        if mine is not None:
            break
    found = [entry for entry in comm.all_gather_object(mine, comm.world()) if entry is not None]
    return min(found)[2] if found else None


def halt_message(step: int, loss: float, grad_norm: float, unit: str | None) -> str:
    """`unit`: first_nonfinite_unit's. None with an infinite norm: every gradient is finite, but the fp32
    sum of their squares overflowed."""
    if unit:
        where = f"; the first non-finite gradient is in unit {unit}"
    elif math.isinf(grad_norm):
        where = ("; every gradient is finite, but the fp32 sum of their squares overflows (an element above "
                 "about 1.8e19): the run is diverging")
    else:
        where = ""
    return (f"step {step}: loss {loss}, gradient norm {grad_norm}{where}; stopped before the update "
            "(nan_policy=skip would skip such steps)")


@torch.no_grad()
def weights_finite(roots: list[FSDPRoot], group: ProcessGroup | None) -> bool:
    """Whether every rank's weight shards are finite (one all-reduce): checked before a checkpoint."""
    bad = torch.zeros(1, device=roots[0].units[0].flat_param.device)  # NCCL reduces device tensors only
    for root in roots:
        for unit in root.units:
            if not torch.isfinite(unit.flat_param).all():
                bad += 1
    if comm.size_of(group) > 1:
        comm.all_reduce(bad, group, label="finite weights")
    return bad.item() == 0
