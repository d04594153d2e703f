"""Plain data parallelism: one flattened gradient all-reduce per optimizer step.

The trainer calls it after the backward of the LAST microbatch only, so gradient accumulation over
microbatches costs no communication. Gradients are already scaled by the global token count, so the
sum over ranks is the gradient of the global mean loss. (The in-tree FSDP replaces this.)
"""

import torch

from parallel import comm


@torch.no_grad()
def all_reduce_gradients(grads: list[torch.Tensor], group: torch.distributed.ProcessGroup) -> None:
    if group.size() == 1 or not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    comm.all_reduce(flat, group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
