"""Context-parallel attention over ring-rotated K/V (`context_parallel_comm=ring`).

K/V blocks rotate around the CP ring point to point, the next rotation posted before the current block
is computed on, so that the hop can overlap the compute; query and key chunks that causality hides from
each other are skipped. The backward rotates the blocks again with their dK/dV accumulators, the last
hop delivering each to its owner. A rank never holds more than two K/V blocks (the current one and the
one arriving): the memory all_gather.py spends on the whole sequence's K/V is not needed.
"""

import torch
from torch.distributed import Work

from parallel import comm
from parallel.context_parallel.lse import attend_block, attend_block_backward, empty_result
from parallel.context_parallel.sharding import CPContext


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPContext,
                   document_ids: torch.Tensor | None) -> torch.Tensor:
    return _RingAttention.apply(q, k, v, cp, document_ids)


class _Rotation:
    """One hop of the ring in flight: send `tensor` to the next rank, receive the previous rank's."""

    def __init__(self, tensor: torch.Tensor, cp: CPContext, label: str):
        # The send buffer must stay alive until the hop completes: the transport reads it meanwhile.
        self.in_transit, self.received, self.label = tensor, torch.empty_like(tensor), label
        self.group = cp.group
        following, previous = (cp.rank + 1) % cp.size, (cp.rank - 1) % cp.size
        self.works: list[Work] = comm.batch_isend_irecv(
            [(True, tensor, following), (False, self.received, previous)], cp.group, label
        )

    def wait(self) -> torch.Tensor:
        for work in self.works:
            comm.wait(work, "send_recv", self.group, self.label)
        return self.received


class _RingAttention(torch.autograd.Function):
    """At step i a rank holds the [K; V] block of rank r - i, the next one already on its way."""

    @staticmethod
    def forward(ctx, q, k, v, cp, document_ids):
        out, lse = empty_result(q)
        block = torch.stack([k, v])
        for step in range(cp.size):
            rotation = _Rotation(block, cp, "cp ring kv") if step < cp.size - 1 else None
            attend_block(q, block, (cp.rank - step) % cp.size, cp, out, lse, document_ids)
            if rotation is not None:
                block = rotation.wait()
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cp, ctx.document_ids = cp, document_ids
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        cp = ctx.cp
        grad_q = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        block = torch.stack([k, v])
        accumulator: _Rotation | None = None  # the dK/dV of the block arriving next, in flight
        for step in range(cp.size):
            rotation = _Rotation(block, cp, "cp ring kv") if step < cp.size - 1 else None
            grads = torch.zeros(block.shape, dtype=torch.float32, device=q.device)
            attend_block_backward(q, grad_out, out, lse, block, (cp.rank - step) % cp.size, cp, grad_q, grads,
                                  ctx.document_ids)
            if accumulator is not None:
                grads += accumulator.wait()
            accumulator = _Rotation(grads, cp, "cp ring dkv")
            if rotation is not None:
                block = rotation.wait()
        grad_k, grad_v = accumulator.wait()  # the last hop brings each rank its own block's gradients
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None
