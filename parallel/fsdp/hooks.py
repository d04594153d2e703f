"""Forward and backward hooks of an FSDP unit, each a small named function.

pre_forward  : unshard (or land the prefetch), install views, prefetch the next unit
post_forward : expect a gradient, hook the outputs for pre_backward, reshard (ZeRO-3)
pre_backward : unshard (or land the prefetch), prefetch the previous unit
on_full_grad : the concatenated gradient of a connected backward is ready -> accumulate or reduce
on_backward_done : this unit's backward finished -> reshard (ZeRO-3)

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
from torch.utils._pytree import tree_leaves

from parallel import comm
from parallel.fsdp.grad_sync import accumulate_unsharded, post_backward

if TYPE_CHECKING:
    from parallel.fsdp.root import FSDPRoot
    from parallel.fsdp.unit import FSDPUnit


def register_hooks(unit: FSDPUnit, root: FSDPRoot) -> None:
    unit.module.register_forward_pre_hook(partial(pre_forward, unit, root))
    unit.module.register_forward_hook(partial(post_forward, unit, root))
    unit.full.register_post_accumulate_grad_hook(partial(on_full_grad, unit))


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def pre_forward(unit: FSDPUnit, root: FSDPRoot, module: nn.Module, args: tuple) -> None:
    if not in_backward():
        comm.set_where("unit", f"forward of {unit.name}")
    unit.unshard()
    if in_backward():
        return
    unit.install_views(on_backward_done)
    root.prefetch_next(unit)


def post_forward(unit: FSDPUnit, root: FSDPRoot, module: nn.Module, args: tuple, output: object) -> None:
    if in_backward():
        return None
    if torch.is_grad_enabled():
        unit.gradients_pending += 1
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad:
                t.register_hook(partial(pre_backward, unit, root))
    if unit.cfg.reshard_after_forward:
        unit.reshard()
    return None


def pre_backward(unit: FSDPUnit, root: FSDPRoot, grad: torch.Tensor) -> None:
    comm.set_where("unit", f"backward of {unit.name}")
    unit.unshard()
    root.prefetch_previous(unit)


def on_full_grad(unit: FSDPUnit, full: torch.Tensor) -> None:
    grad, full.grad = full.grad, None
    if unit.is_last_microbatch:
        post_backward(unit, grad)
    else:
        accumulate_unsharded(unit, grad)
    on_backward_done(unit)


def on_backward_done(unit: FSDPUnit) -> None:
    unit.gradients_pending -= 1
    if unit.cfg.reshard_after_forward:
        unit.reshard()
