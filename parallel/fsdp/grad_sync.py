"""The gradient path of an FSDP unit, as small named steps.

Non-last microbatches only accumulate into the fp32 unsharded accumulator. The last microbatch runs
the post-backward path once per unit per step:

    unsharded_grad -> (SP) sum_partial_grads_over_tp -> reduce_scatter_grad
                   -> (HSDP) start_replica_all_reduce -> accumulate_shard_grad

and `finalize` (at the end of the step's backward) waits for the asynchronous replica all-reduces.
Gradients arrive already scaled by the global token count, so every reduction is a SUM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from parallel import comm

if TYPE_CHECKING:
    from parallel.fsdp.unit import FSDPUnit


def accumulate_unsharded(unit: FSDPUnit, grad: torch.Tensor, offset: int = 0) -> None:
    """Add a (compute-dtype) gradient into the fp32 unsharded accumulator at `offset`.

    A whole flat gradient arriving first is adopted (no zero-filled buffer to pay for); per-view
    gradients start from zeros, so a parameter that got no gradient contributes nothing.
    """
    if unit.grad_accumulator is None:
        if grad.numel() == unit.spec.padded:
            unit.grad_accumulator = grad.to(torch.float32)
            return
        unit.grad_accumulator = torch.zeros(unit.spec.padded, dtype=torch.float32, device=grad.device)
    unit.grad_accumulator[offset : offset + grad.numel()].add_(grad.reshape(-1))


def unsharded_grad(unit: FSDPUnit, grad: torch.Tensor | None) -> torch.Tensor:
    """The step's full flat gradient in fp32: this microbatch's (None: no parameter of the unit got one)
    plus what earlier ones accumulated."""
    if grad is None:
        if unit.grad_accumulator is None:
            return torch.zeros(unit.spec.padded, dtype=torch.float32, device=unit.flat_param.device)
        return unit.grad_accumulator
    if unit.grad_accumulator is None:
        return grad.to(torch.float32)
    accumulate_unsharded(unit, grad)
    return unit.grad_accumulator


def sum_partial_grads_over_tp(unit: FSDPUnit, flat_grad: torch.Tensor) -> torch.Tensor:
    """Sequence parallel: TP-replicated parameters (norm weights) saw 1/tp of the tokens on each TP
    rank, so their gradient slices are partial sums; add them up over TP (one all-reduce per unit)."""
    if not (unit.tp.sequence_parallel and unit.tp.size > 1 and unit.tp_replicated):
        return flat_grad
    parts = torch.cat([flat_grad[o : o + n] for o, n in unit.tp_replicated])
    comm.all_reduce(parts, unit.tp.group, label=unit.name)
    start = 0
    for offset, numel in unit.tp_replicated:
        flat_grad[offset : offset + numel] = parts[start : start + numel]
        start += numel
    return flat_grad


def reduce_scatter_grad(unit: FSDPUnit, flat_grad: torch.Tensor) -> torch.Tensor:
    """Sum over the shard group, in reduce_dtype; returns this rank's shard of the sum."""
    flat_grad = flat_grad.to(unit.cfg.reduce_dtype)
    if unit.spec.world == 1:
        return flat_grad
    shard = torch.empty(unit.spec.shard_size, dtype=unit.cfg.reduce_dtype, device=flat_grad.device)
    comm.reduce_scatter_tensor(shard, flat_grad, unit.shard_group, label=unit.name)
    return shard


def start_replica_all_reduce(unit: FSDPUnit, shard_grad: torch.Tensor) -> None:
    """HSDP: sum the shard over replicas asynchronously, overlapping the next units' collectives."""
    work = comm.all_reduce(shard_grad, unit.replicate_group, async_op=True, label=unit.name)
    unit.replica_reduce = (work, shard_grad)


def accumulate_shard_grad(unit: FSDPUnit, shard_grad: torch.Tensor) -> None:
    grad = shard_grad.to(torch.float32)
    if unit.flat_param.grad is None:
        unit.flat_param.grad = grad
    else:
        unit.flat_param.grad += grad


def post_backward(unit: FSDPUnit, grad: torch.Tensor | None) -> None:
    """Last microbatch: reduce the step's gradient of this unit, once."""
    shard_grad = reduce_scatter_grad(unit, sum_partial_grads_over_tp(unit, unsharded_grad(unit, grad)))
    if unit.replicate_group is not None and unit.replicate_group.size() > 1:
        start_replica_all_reduce(unit, shard_grad)
    else:
        accumulate_shard_grad(unit, shard_grad)
    unit.grad_accumulator = None


def finalize(unit: FSDPUnit) -> None:
    """End of the step's backward: land the asynchronous replica all-reduce."""
    if unit.replica_reduce is not None:
        work, shard_grad = unit.replica_reduce
        comm.wait(work, "all_reduce", unit.replicate_group, unit.name)
        accumulate_shard_grad(unit, shard_grad)
        unit.replica_reduce = None
