"""Forward and backward hooks of an FSDP unit, each a small named function.

pre_forward  : unshard (or land the prefetch), install views, prefetch the next unit, and route the
               unit's inputs through an identity autograd function whose backward marks its end
post_forward : expect a gradient, hook the outputs for pre_backward, reshard (ZeRO-3)
pre_backward : unshard (or land the prefetch), prefetch the previous unit, and queue a callback at the
               end of the whole backward, the fallback end for units whose inputs need no gradient
end_of_backward : this forward's backward is over (whichever of the two comes first) -> when this
               microbatch reduces (the last; every one with grad_reduce=per_microbatch) start the
               reduction (asynchronous, root.reductions), then reshard (ZeRO-3). In a zero-bubble
               schedule's B the reduction waits for the weight gradients: it is queued behind the
               unit's deferred GEMMs and starts in W (parallel/weight_grads.py)

The end of a unit's backward does not depend on which parameters got gradients: a parameter unused in
some microbatch (an unused branch, an expert without tokens) contributes nothing, and the unit still
reduces and reshards, with `optimize_backward_concat` on or off.

Activation-checkpoint recompute that re-enters a unit's forward runs inside the autograd engine. The
unit is normally already unsharded for backward then; pre_forward only makes sure of it (landing an
in-flight prefetch, gathering only if it really is sharded) and installs no views and prefetches
nothing, and post_forward does not reshard, so recompute costs no extra all-gather.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.autograd import Variable
from torch.utils._pytree import tree_leaves

from parallel import comm, weight_grads
from parallel.fsdp.grad_sync import reduce_gradient, unsharded_grad

if TYPE_CHECKING:
    from parallel.fsdp.root import FSDPRoot
    from parallel.fsdp.unit import FSDPUnit


class BackwardTicket:
    """One forward with grad of a unit, whose backward is to end exactly once, at the weights that
    forward saw (`version`: the shard's version counter then)."""

    __slots__ = ("queued", "done", "version")

    def __init__(self, version: int) -> None:
        self.queued = self.done = False
        self.version = version


class _EndOfBackward(torch.autograd.Function):
    """Identity on the unit's inputs; its backward runs once the gradients w.r.t. them are computed,
    which is after the unit's own gradient computation (as FSDP2's RegisterPostBackwardFunction)."""

    @staticmethod
    def forward(ctx, on_backward_end, *inputs: torch.Tensor):
        ctx.on_backward_end = on_backward_end
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        ctx.on_backward_end()
        return (None, *grads)


def register_hooks(unit: FSDPUnit, root: FSDPRoot, span: nn.Module) -> None:
    """On `span`, the module whose forward spans every use of the unit's parameters: the unit's own, or
    an enclosing one where another module reads them too (a tied output head)."""
    span.register_forward_pre_hook(partial(pre_forward, unit, root))
    span.register_forward_hook(partial(post_forward, unit, root))


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def pre_forward(unit: FSDPUnit, root: FSDPRoot, module: nn.Module, args: tuple) -> tuple | None:
    if not in_backward():
        comm.set_where("unit", f"forward of {unit.name}")
    unit.unshard()
    if in_backward():
        if torch.is_grad_enabled() and not unit.views_have_autograd_edges():
            # A reentrant checkpoint around the unit ran its forward under no_grad: the recompute would
            # use views without an autograd edge, and the unit's gradients would vanish without an error.
            raise RuntimeError(
                f"FSDP unit {unit.name} is recomputed in backward with parameter views made without grad (a "
                "reentrant activation checkpoint around an FSDP unit would silently drop its gradients); "
                "checkpoint with use_reentrant=False, or inside the unit "
                "(parallel.activation_checkpoint.checkpoint_forward)")
        return None
    routed = None
    if torch.is_grad_enabled():
        # Before the views: autograd runs the later-created of two ready nodes first, so the views'
        # backward (and the gradient's arrival) comes before the end of the unit's.
        unit.ticket = BackwardTicket(unit.flat_param._version)
        routed = _route_inputs(args, partial(end_of_backward, unit, root, unit.ticket))
    unit.install_views()
    root.prefetch_next(unit)
    return routed


def _route_inputs(args: tuple, on_backward_end) -> tuple | None:
    """The positional tensor inputs that need a gradient go through _EndOfBackward (None: there are none).
    A routed input keeps its gradient sink: a parameter view passed in (the tied embedding, which the
    head unit reads as its weight) still takes its GEMM's gradient (parallel/weight_grads.py)."""
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
    if not positions:
        return None
    routed = _EndOfBackward.apply(on_backward_end, *(args[i] for i in positions))
    out = list(args)
    for i, tensor in zip(positions, routed):
        if (sink := weight_grads.sink_of(args[i])) is not None:
            weight_grads.set_sink(tensor, sink)
        out[i] = tensor
    return tuple(out)


def post_forward(unit: FSDPUnit, root: FSDPRoot, module: nn.Module, args: tuple, output: object) -> None:
    if in_backward():
        return None
    if torch.is_grad_enabled():
        unit.gradients_pending += 1
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(partial(pre_backward, unit, root, unit.ticket))
    if unit.cfg.reshard_after_forward:
        unit.reshard()
    return None


def pre_backward(unit: FSDPUnit, root: FSDPRoot, ticket: BackwardTicket, grad: torch.Tensor) -> None:
    comm.set_where("unit", f"backward of {unit.name}")
    if unit.flat_param._version != ticket.version:
        # Autograd's own check cannot see it: the gathered weights do not share the shard's version
        # counter, and the backward would re-gather the changed shard and mix it with the old activations.
        raise RuntimeError(f"FSDP unit {unit.name}: its parameters changed in place between a forward and its "
                           "backward (an optimizer step or a checkpoint load inside a step)")
    unit.unshard()
    root.prefetch_previous(unit)
    if not ticket.queued:
        ticket.queued = True
        Variable._execution_engine.queue_callback(partial(end_of_backward, unit, root, ticket))


def end_of_backward(unit: FSDPUnit, root: FSDPRoot, ticket: BackwardTicket) -> None:
    """The backward of one forward of the unit is over: start reducing when this microbatch reduces (a
    collective every rank reaches, used parameters or not), then reshard."""
    if ticket.done:
        return
    ticket.done = True
    if unit.reduces_now:
        reduce = partial(_start_reduction, unit, root, unit.is_last_microbatch)
        if not weight_grads.defer(reduce):  # in a zero-bubble B, the reduction follows the unit's W GEMMs
            reduce()
    unit.gradients_pending -= 1
    if unit.cfg.reshard_after_forward:
        unit.reshard()


def _start_reduction(unit: FSDPUnit, root: FSDPRoot, last_microbatch: bool) -> None:
    flat_grad = unsharded_grad(unit)
    unit.release_main_grads()
    reduction = reduce_gradient(unit, flat_grad, last_microbatch)
    # What it holds in flight: its reduce_dtype copy (the fp32 gradient goes once cast, grad_sync.py).
    root.reductions.push(reduction, flat_grad.numel() * unit.cfg.reduce_dtype.itemsize)
