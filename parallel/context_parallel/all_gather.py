"""Context-parallel attention over all-gathered K/V (`context_parallel_comm=all_gather`).

One all-gather of K and one of V over the CP group, at n_kv_heads (GQA is expanded only after
communicating, so the collective moves no repeated heads); the backward reduce-scatters dK/dV back to
their owners. Local queries then attend to the gathered blocks one by one, with the same chunk-level
causality as the ring. One collective each for K and V, at the cost of holding the whole sequence's
K/V on every rank.
"""

import torch
from torch.distributed import ProcessGroup

from parallel.context_parallel.lse import SEQ, attend_block, attend_block_backward, empty_result
from parallel.context_parallel.sharding import CPContext
from parallel.tensor_parallel import gather_from_sp


def all_gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPContext,
                         document_ids: torch.Tensor | None) -> torch.Tensor:
    return _GatheredAttention.apply(q, _gather_kv(k, cp.group), _gather_kv(v, cp.group), cp, document_ids)


def _gather_kv(t: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[b, kv_heads, s/C, d] -> [b, kv_heads, s, d], rank r's share at block r; backward reduce-scatters."""
    b, kvh, s, d = t.shape
    gathered = gather_from_sp(t.transpose(1, 2).reshape(b, s, kvh * d), group)
    return gathered.view(b, -1, kvh, d).transpose(1, 2)


class _GatheredAttention(torch.autograd.Function):
    """Local queries against the gathered K/V, block by block (rank j's share is block j)."""

    @staticmethod
    def forward(ctx, q, k_all, v_all, cp, document_ids):
        out, lse = empty_result(q)
        width = k_all.shape[SEQ] // cp.size
        for holder in range(cp.size):
            block = torch.stack([k_all[:, :, holder * width : (holder + 1) * width],
                                 v_all[:, :, holder * width : (holder + 1) * width]])
            attend_block(q, block, holder, cp, out, lse, document_ids)
        ctx.save_for_backward(q, k_all, v_all, out, lse)
        ctx.cp, ctx.document_ids = cp, document_ids
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k_all, v_all, out, lse = ctx.saved_tensors
        cp, width = ctx.cp, k_all.shape[SEQ] // ctx.cp.size
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        grad_kv = torch.zeros((2, *k_all.shape), dtype=torch.float32, device=q.device)
        for holder in range(cp.size):
            cols = slice(holder * width, (holder + 1) * width)
            block = torch.stack([k_all[:, :, cols], v_all[:, :, cols]])
            attend_block_backward(q, grad_out, out, lse, block, holder, cp, grad_q, grad_kv[:, :, :, cols],
                                  ctx.document_ids)
        return grad_q.to(q.dtype), grad_kv[0].to(k_all.dtype), grad_kv[1].to(v_all.dtype), None, None
