"""The gradient path of an FSDP unit, as small named steps.

With `grad_reduce=last_microbatch` (the default), non-last microbatches only accumulate into the fp32
unsharded accumulator and the last one reduces the step's gradient once per unit. With
`grad_reduce=per_microbatch`, every microbatch reduces its own gradient into an fp32 shard-sized sum
(M reduce-scatters per unit per step, no unsharded gradient kept between microbatches). A reduction:

    unsharded_grad -> (SP) sum_partial_grads_over_tp -> reduce_scatter_grad
                   -> (HSDP, on the step's last microbatch) sum_over_replicas -> accumulate_shard_grad

is a generator of stages that the ReductionQueue (reductions.py) runs asynchronously: each collective
is issued, the backward goes on, and the wait comes at a later fixed point. Gradients arrive already
scaled by the global token count, so every reduction is a SUM.
"""

from __future__ import annotations

import weakref
from collections.abc import Generator, Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from parallel import comm
from parallel.weight_grads import accumulate_product, is_deferring

if TYPE_CHECKING:
    from parallel.fsdp.hooks import BackwardTicket
    from parallel.fsdp.unit import FSDPUnit

Stages = Generator[None, None, torch.Tensor]


def _new_accumulator(unit: FSDPUnit) -> None:
    """Allocated, not zero-filled: every parameter slice starts unwritten. The padding is reduce-scattered
    with the rest, so it is zeroed now."""
    unit.grad_accumulator = torch.empty(unit.spec.padded, dtype=torch.float32, device=unit.flat_param.device)
    unit.grad_accumulator[unit.spec.total :].zero_()
    unit.unwritten = set(range(len(unit.spec.shapes)))


def accumulator_slice(unit: FSDPUnit, index: int) -> torch.Tensor:
    """Parameter `index`'s slice of the unit's fp32 unsharded gradient accumulator. A slice is written by
    its parameter's first gradient of the step; one no gradient reached is zeroed when the accumulator is
    handed over, and a main_grad parameter's when it is bound (`unit.unwritten`: not written yet)."""
    if unit.grad_accumulator is None:
        _new_accumulator(unit)
    offset = unit.param_offsets[index]
    return unit.grad_accumulator[offset : offset + unit.spec.numels[index]]


def _claim_slice(unit: FSDPUnit, index: int) -> tuple[torch.Tensor, bool]:
    """Parameter `index`'s slice, about to be written, and whether this is its first write of the step
    (it holds no values yet)."""
    piece = accumulator_slice(unit, index)
    first = index in unit.unwritten
    unit.unwritten.discard(index)
    return piece, first


def zeroed_slice(unit: FSDPUnit, index: int) -> torch.Tensor:
    """A slice that holds zeros from now on, for a module that accumulates into it itself (main_grad)."""
    piece, first = _claim_slice(unit, index)
    return piece.zero_() if first else piece


def accumulate_param_grad(unit: FSDPUnit, index: int, grad: torch.Tensor) -> None:
    """Add one parameter's (compute-dtype) gradient into its fp32 slice: in place, or as 0 + grad if it is
    the slice's first, which costs one pass instead of a zero-fill plus an add and gives the same bits (a
    -0.0 becomes +0.0 either way), so optimize_backward_concat on and off agree to the bit."""
    piece, first = _claim_slice(unit, index)
    piece = piece.view(grad.shape)
    if first:
        torch.add(grad, 0.0, out=piece)
    else:
        piece.add_(grad)


def refuse_late_gradient(unit: FSDPUnit, ticket: BackwardTicket | None) -> None:
    """A gradient of the forward `ticket` arriving when the unit reduces now and that forward's (or the
    latest forward's) backward already ended would miss the reduction, or land in an accumulator being
    reduced."""
    if unit.reduces_now and ((ticket is not None and ticket.done) or (unit.ticket is not None and unit.ticket.done)):
        raise RuntimeError(f"FSDP unit {unit.name}: a gradient arrived after the unit's backward ended (a unit "
                           f"called twice in one forward, or two backwards through one forward, is not supported)")


class ParamGradSink:
    """One parameter view's gradient sink (parallel/weight_grads.py; only linears use it): its slice of
    the unit's accumulator, for the forward `ticket` that installed the view. It holds the unit weakly:
    the parameter views hold their sinks, and the unit holds the views."""

    __slots__ = ("unit_ref", "index", "fuses", "ticket")

    def __init__(self, unit: FSDPUnit, index: int, fuses: bool, ticket: BackwardTicket | None):
        self.unit_ref, self.index, self.fuses, self.ticket = weakref.ref(unit), index, fuses, ticket

    def add(self, grad: torch.Tensor) -> None:
        accumulate_param_grad(self.unit_ref(), self.index, grad)

    def add_product(self, grad_rows: torch.Tensor, input_rows: torch.Tensor) -> None:
        unit = self.unit_ref()
        if not is_deferring():  # in the backward (a zero-bubble W runs after it, before the reduction)
            refuse_late_gradient(unit, self.ticket)
        piece, first = _claim_slice(unit, self.index)
        accumulate_product(piece.view(unit.spec.shapes[self.index]), grad_rows, input_rows, first)


def write_flat_grad(unit: FSDPUnit, grads: Sequence[torch.Tensor | None]) -> None:
    """The concat of a connected backward: every parameter's gradient written into its slice of the fp32
    flat accumulator (None: the parameter got none, nothing to add). No compute-dtype concat and no
    separate accumulation pass: the step's flat gradient never exists twice."""
    for index, grad in enumerate(grads):
        if grad is not None:
            accumulate_param_grad(unit, index, grad)


def unsharded_grad(unit: FSDPUnit) -> torch.Tensor:
    """The flat gradient to reduce, in fp32: everything this step's microbatches accumulated (zeros where
    no gradient came); the accumulator is handed over."""
    if unit.grad_accumulator is None:
        return torch.zeros(unit.spec.padded, dtype=torch.float32, device=unit.flat_param.device)
    for index in list(unit.unwritten):
        zeroed_slice(unit, index)
    flat, unit.grad_accumulator = unit.grad_accumulator, None
    return flat


def sum_partial_grads_over_tp(unit: FSDPUnit, flat_grad: torch.Tensor) -> Iterator[None]:
    """Sequence parallel: TP-replicated parameters (norm weights) saw 1/tp of the tokens on each TP
    rank, so their gradient slices are partial sums; add them up over TP (one all-reduce per unit)."""
    if not (unit.tp.sequence_parallel and unit.tp.size > 1 and unit.tp_replicated):
        return
    parts = torch.cat([flat_grad[o : o + n] for o, n in unit.tp_replicated])
    work = comm.all_reduce(parts, unit.tp.group, async_op=True, label=unit.name)
    yield
    comm.wait(work, "all_reduce", unit.tp.group, unit.name)
    start = 0
    for offset, numel in unit.tp_replicated:
        flat_grad[offset : offset + numel] = parts[start : start + numel]
        start += numel


def reduce_scatter_grad(unit: FSDPUnit, flat_grad: torch.Tensor) -> Stages:
    """Sum `flat_grad` (in reduce_dtype) over the shard group; returns this rank's shard of the sum."""
    if unit.spec.world == 1:
        return flat_grad
    shard = torch.empty(unit.spec.shard_size, dtype=unit.cfg.reduce_dtype, device=flat_grad.device)
    work = comm.reduce_scatter_tensor(shard, flat_grad, unit.shard_group, async_op=True, label=unit.name,
                                      consume_input=True)
    yield
    comm.wait(work, "reduce_scatter", unit.shard_group, unit.name)
    return shard


def sum_over_replicas(unit: FSDPUnit, shard_grad: torch.Tensor) -> Stages:
    """HSDP: sum the shard over the replicas (once per step)."""
    if unit.replicate_group is None or unit.replicate_group.size() == 1:
        return shard_grad
    shard_grad = shard_grad.to(unit.cfg.reduce_dtype)
    work = comm.all_reduce(shard_grad, unit.replicate_group, async_op=True, label=unit.name)
    yield
    comm.wait(work, "all_reduce", unit.replicate_group, unit.name)
    return shard_grad


def accumulate_shard_grad(unit: FSDPUnit, shard_grad: torch.Tensor) -> None:
    grad = shard_grad.to(torch.float32)
    if unit.flat_param.grad is None:
        unit.flat_param.grad = grad
    else:
        unit.flat_param.grad += grad


def reduce_gradient(unit: FSDPUnit, flat_grad: torch.Tensor, last_microbatch: bool) -> Iterator[None]:
    """The stages of one reduction of `flat_grad` (from unsharded_grad) into the unit's shard gradient."""
    yield from sum_partial_grads_over_tp(unit, flat_grad)
    reduce_input = flat_grad.to(unit.cfg.reduce_dtype)
    # With reduce_dtype=bf16 only the cast is in flight: the fp32 gradient goes now, not when the
    # reduction ends (it held 1.5x the bytes of an fp32 reduction).
    del flat_grad
    shard_grad = yield from reduce_scatter_grad(unit, reduce_input)
    del reduce_input
    if unit.cfg.grad_reduce == "per_microbatch":
        unit.shard_grad_sum = shard_grad.to(torch.float32) if unit.shard_grad_sum is None \
            else unit.shard_grad_sum.add_(shard_grad)
        if not last_microbatch:
            return
        shard_grad, unit.shard_grad_sum = unit.shard_grad_sum, None
    accumulate_shard_grad(unit, (yield from sum_over_replicas(unit, shard_grad)))
