"""Activation checkpointing that composes with FSDP units.

`checkpoint_forward` recomputes a module's forward in backward (non-reentrant checkpoint). The wrapper
replaces the module's `forward`, so the module's own hooks (an FSDP unit's pre/post-forward) run
outside the checkpointed region and recompute never re-enters them. Non-reentrant checkpointing placed
around a unit from outside does re-enter them during backward; the FSDP hooks detect that and skip (see
parallel/fsdp/hooks.py), so neither placement costs an extra all-gather. A reentrant checkpoint around a
unit runs its forward without grad, so it would lose the unit's gradients: the hooks refuse it.
"""

from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_forward(module: nn.Module) -> None:
    inner = module.forward

    def forward(*args, **kwargs):
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward
