"""Context parallelism: each of C ranks holds 1/C of every sequence, load-balanced for causal attention.

Sharding: a sequence splits into 2C chunks; CP rank r holds chunks r and 2C-1-r ("head-tail"), so
every rank has the same causal work (a chunk early in the sequence sees few keys, its partner late in
the sequence many). Tokens, targets and rotary positions are sharded once, by the data path; rotary
embeddings use the tokens' global positions.

Attention sees all keys of the sequence in one of two ways (`context_parallel_comm`):

  all_gather  K and V (at n_kv_heads: GQA is expanded only after communicating) are all-gathered over
              the CP group (the backward reduce-scatters dK/dV); local queries attend to the gathered
              blocks one by one, with the same chunk-level causality as the ring.
  ring        K/V blocks rotate around the CP ring point to point, the next rotation posted before the
              current block is computed on; partial results merge by their log-sum-exp in fp32; query
              and key chunks that causality hides from each other are skipped. The backward rotates the
              blocks again with their dK/dV accumulators, the last hop delivering each to its owner. A
              rank never holds more than two K/V blocks (the current one and the one arriving).

Both use one attention core that returns its log-sum-exp (`attention_with_lse`) and a backward
that takes the queries' final output and log-sum-exp: torch's CPU flash-attention kernel on CPU, the
plain formula in fp32 elsewhere (the two are held together by tests/unit/test_cp_attention.py). The
plain formula runs over blocks of query rows, so that a long chunk never holds more than
SCORES_BUDGET fp32 scores at once.

With document ids (block-causal attention over packed documents; every rank has the whole sequence's),
each visible chunk pair also masks the query-key pairs of different documents. A query can then see no
key of a block at all: its block result is 0 with log-sum-exp -inf, which the merge skips.
"""

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup, Work

from parallel import comm
from parallel.tensor_parallel import gather_from_sp

SEQ = 2  # of [batch, heads, seq, head_dim]
# fp32 attention scores (1 GiB) one block of query rows of the plain formula may hold: at 128k tokens
# over 4 ranks a chunk pair's whole score matrix would be tens of GiB per tensor.
SCORES_BUDGET = 2**28


@dataclass
class CPContext:
    group: ProcessGroup | None = None
    comm_mode: str = "all_gather"  # all_gather | ring
    unmasked_pairs: int = 0  # (query, key) pairs this rank's attention computed: the load balance

    @property
    def size(self) -> int:
        return comm.size_of(self.group)

    @property
    def rank(self) -> int:
        return comm.rank_in(self.group)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunks r and 2C-1-r of a full sequence dimension."""
        if self.size == 1:
            return x
        self._check_length(x.shape[dim], 2 * self.size)
        chunks = x.chunk(2 * self.size, dim)
        return torch.cat([chunks[self.rank], chunks[2 * self.size - 1 - self.rank]], dim).contiguous()

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of the `local_len` tokens this CP rank holds."""
        if self.size > 1:
            self._check_length(local_len, 2)
        half = local_len // 2
        ranges = [torch.arange(c * half, (c + 1) * half, device=device) for c in (self.rank, 2 * self.size - 1 - self.rank)]
        return torch.cat(ranges) if self.size > 1 else torch.arange(local_len, device=device)

    @staticmethod
    def _check_length(length: int, chunks: int) -> None:
        # Uneven chunks would put tokens at other positions than the rotary positions and the
        # chunk-level causality assume (validate refuses such a seq_len; this guards direct callers).
        if length % chunks:
            raise ValueError(f"context parallelism: a sequence dimension of {length} does not split into {chunks} "
                             f"equal chunks")


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d)) v and the rows' log-sum-exp, both fp32; k/v have q's head count; `causal`
    (q and k the same tokens): each query sees the keys up to itself. `allowed` [b, s_q, s_k] bool
    (block_causal's documents, causality included) replaces `causal`; a query with no allowed key gets
    output 0 and log-sum-exp -inf, so merging it adds nothing. On CPU torch's flash kernel, which returns
    the log-sum-exp; elsewhere the plain formula."""
    if q.device.type != "cpu":
        return math_attention_with_lse(q, k, v, causal, allowed)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal and allowed is None, attn_mask=_additive(allowed, q.dtype))
    if allowed is not None:  # the kernel gives such a row a log-sum-exp of 0 (and, today, an output of 0)
        blind = ~allowed.any(-1)[:, None]
        lse = lse.masked_fill(blind, float("-inf"))
        out = out.masked_fill(blind[..., None], 0.0)  # the merge would turn anything else times 0 into NaN
    return out.float(), lse


def math_attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                            allowed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    outs, lses = [], []
    for rows in _row_blocks(q, k):
        scores = _scores(q[:, :, rows], k, causal, allowed, rows)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.unsqueeze(-1)).masked_fill(scores == float("-inf"), 0.0)  # no NaN rows
        outs.append(probs @ v.float())
        lses.append(lse)
    return torch.cat(outs, SEQ), torch.cat(lses, -1)


def attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                       lse: torch.Tensor, causal: bool, allowed: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (fp32) of one query/key block, given the FINAL output and log-sum-exp of the queries
    over all blocks: the probabilities exp(s - lse) are then this block's share of the whole softmax."""
    if q.device.type != "cpu":
        return math_attention_backward(grad_out, q, k, v, out, lse, causal, allowed)
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out.to(q.dtype), q, k, v, out.to(q.dtype), lse, 0.0, causal and allowed is None,
        attn_mask=_additive(allowed, q.dtype))
    return tuple(g.float() for g in grads)


def math_attention_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            out: torch.Tensor, lse: torch.Tensor, causal: bool, allowed: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grad_out, out = grad_out.float(), out.float()
    grad_q, grad_k, grad_v = [], None, None
    for rows in _row_blocks(q, k):
        probs = torch.exp(_scores(q[:, :, rows], k, causal, allowed, rows) - lse[..., rows].unsqueeze(-1))
        delta = (grad_out[:, :, rows] * out[:, :, rows]).sum(-1, keepdim=True)  # rowsum(dO * O)
        grad_scores = probs * (grad_out[:, :, rows] @ v.float().transpose(-2, -1) - delta) * q.shape[-1] ** -0.5
        grad_q.append(grad_scores @ k.float())
        block_k = grad_scores.transpose(-2, -1) @ q[:, :, rows].float()
        block_v = probs.transpose(-2, -1) @ grad_out[:, :, rows]
        grad_k = block_k if grad_k is None else grad_k + block_k
        grad_v = block_v if grad_v is None else grad_v + block_v
    return torch.cat(grad_q, SEQ), grad_k, grad_v


def _row_blocks(q: torch.Tensor, k: torch.Tensor) -> list[slice]:
    """The query rows of the plain formula's blocks: each holds at most SCORES_BUDGET scores."""
    batch, heads, rows, _ = q.shape
    per_block = max(1, SCORES_BUDGET // (batch * heads * k.shape[SEQ]))
    return [slice(start, min(start + per_block, rows)) for start in range(0, rows, per_block)]


def _additive(allowed: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """[b, s_q, s_k] bool -> the kernel's [b, 1, s_q, s_k] additive mask (0 or -inf, in q's dtype)."""
    if allowed is None:
        return None
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))[:, None]


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, allowed: torch.Tensor | None, rows: slice) -> torch.Tensor:
    """Scores of the query rows `rows` (q holds those rows only) against every key."""
    scores = (q.float() @ k.float().transpose(-2, -1)) * q.shape[-1] ** -0.5
    if allowed is not None:
        scores = scores.masked_fill(~allowed[:, None, rows], float("-inf"))
    elif causal:  # q and k the same tokens: row i sees keys up to i
        keys = torch.arange(k.shape[SEQ], device=q.device)
        hidden = keys[None, :] > torch.arange(rows.start, rows.stop, device=q.device)[:, None]
        scores = scores.masked_fill(hidden, float("-inf"))
    return scores


def _expand_kv(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def _sum_kv_groups(t: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of _expand_kv: sum each KV head's query-head group."""
    b, h, s, d = t.shape
    return t.view(b, kv_heads, h // kv_heads, s, d).sum(2)


def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPContext,
                               document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence: [b, heads, s/C, d] -> same.
    `document_ids` [b, s] (block_causal; the whole sequence's, on every CP rank): a query sees only the
    keys of its own document."""
    if cp.comm_mode == "ring":
        return _RingAttention.apply(q, k, v, cp, document_ids)
    return _GatheredAttention.apply(q, _gather_kv(k, cp.group), _gather_kv(v, cp.group), cp, document_ids)


def _gather_kv(t: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """[b, kv_heads, s/C, d] -> [b, kv_heads, s, d], rank r's share at block r; backward reduce-scatters."""
    b, kvh, s, d = t.shape
    gathered = gather_from_sp(t.transpose(1, 2).reshape(b, s, kvh * d), group)
    return gathered.view(b, -1, kvh, d).transpose(1, 2)


# --- one rank's queries against one rank's block of keys -------------------------------------------
def _visible_pairs(rank: int, holder: int, size: int) -> list[tuple[int, int, int, int]]:
    """(query half, key half, query chunk, key chunk) of this rank's queries and `holder`'s block that
    causality does not hide: halves are chunks (rank, 2C-1-rank) of the sequence; a pair of the same chunk
    is a lower triangle, a key chunk before the query chunk is seen whole, one after it not at all."""
    q_chunks, k_chunks = (rank, 2 * size - 1 - rank), (holder, 2 * size - 1 - holder)
    return [(qa, kb, q_chunk, k_chunk) for qa, q_chunk in enumerate(q_chunks)
            for kb, k_chunk in enumerate(k_chunks) if k_chunk <= q_chunk]


def _allowed(document_ids: torch.Tensor | None, q_chunk: int, k_chunk: int, half: int) -> torch.Tensor | None:
    """block_causal: which (query, key) pairs of two chunks share a document, causal within one chunk
    ([b, half, half] bool); None without documents."""
    if document_ids is None:
        return None
    queries = document_ids[:, q_chunk * half : (q_chunk + 1) * half]
    keys = document_ids[:, k_chunk * half : (k_chunk + 1) * half]
    allowed = queries[:, :, None] == keys[:, None, :]
    if q_chunk == k_chunk:
        allowed &= torch.ones(half, half, dtype=torch.bool, device=allowed.device).tril()
    return allowed


def _attend_block(q: torch.Tensor, block: torch.Tensor, holder: int, cp: CPContext, out: torch.Tensor,
                  lse: torch.Tensor, document_ids: torch.Tensor | None) -> None:
    """Merge the attention of q over `holder`'s [K; V] block into the running out / lse (in place)."""
    half, heads = q.shape[SEQ] // 2, q.shape[1]
    for qa, kb, q_chunk, k_chunk in _visible_pairs(cp.rank, holder, cp.size):
        rows, cols, causal = slice(qa * half, (qa + 1) * half), slice(kb * half, (kb + 1) * half), q_chunk == k_chunk
        keys, values = (_expand_kv(t[:, :, cols], heads) for t in block)
        allowed = _allowed(document_ids, q_chunk, k_chunk, half)
        part, part_lse = attention_with_lse(q[:, :, rows], keys, values, causal, allowed)
        merged = torch.logaddexp(lse[:, :, rows], part_lse)
        base = merged.masked_fill(merged == float("-inf"), 0.0)  # a row no allowed key reached yet stays 0
        out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - base).unsqueeze(-1)
                           + part * torch.exp(part_lse - base).unsqueeze(-1))
        lse[:, :, rows] = merged
        cp.unmasked_pairs += half * (half + 1) // 2 if causal else half * half


def _attend_block_backward(q: torch.Tensor, grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                           block: torch.Tensor, holder: int, cp: CPContext, grad_q: torch.Tensor,
                           grad_block: torch.Tensor, document_ids: torch.Tensor | None) -> None:
    """Add this block's share of dQ into grad_q and its dK/dV into grad_block (in place)."""
    half, heads, kv_heads = q.shape[SEQ] // 2, q.shape[1], block.shape[2]
    for qa, kb, q_chunk, k_chunk in _visible_pairs(cp.rank, holder, cp.size):
        rows, cols = slice(qa * half, (qa + 1) * half), slice(kb * half, (kb + 1) * half)
        keys, values = (_expand_kv(t[:, :, cols], heads) for t in block)
        dq, dk, dv = attention_backward(grad_out[:, :, rows], q[:, :, rows], keys, values, out[:, :, rows],
                                        lse[:, :, rows], q_chunk == k_chunk,
                                        _allowed(document_ids, q_chunk, k_chunk, half))
        grad_q[:, :, rows] += dq
        grad_block[0][:, :, cols] += _sum_kv_groups(dk, kv_heads)
        grad_block[1][:, :, cols] += _sum_kv_groups(dv, kv_heads)


def _empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return out, torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)


# --- all_gather ---------------------------------------------------------------------------------
class _GatheredAttention(torch.autograd.Function):
    """Local queries against the gathered K/V, block by block (rank j's share is block j)."""

    @staticmethod
    def forward(ctx, q, k_all, v_all, cp, document_ids):
        out, lse = _empty_result(q)
        width = k_all.shape[SEQ] // cp.size
        for holder in range(cp.size):
            block = torch.stack([k_all[:, :, holder * width : (holder + 1) * width],
                                 v_all[:, :, holder * width : (holder + 1) * width]])
            _attend_block(q, block, holder, cp, out, lse, document_ids)
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
            _attend_block_backward(q, grad_out, out, lse, block, holder, cp, grad_q, grad_kv[:, :, :, cols],
                                   ctx.document_ids)
        return grad_q.to(q.dtype), grad_kv[0].to(k_all.dtype), grad_kv[1].to(v_all.dtype), None, None


# --- ring ---------------------------------------------------------------------------------------
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
        out, lse = _empty_result(q)
        block = torch.stack([k, v])
        for step in range(cp.size):
            rotation = _Rotation(block, cp, "cp ring kv") if step < cp.size - 1 else None
            _attend_block(q, block, (cp.rank - step) % cp.size, cp, out, lse, document_ids)
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
            _attend_block_backward(q, grad_out, out, lse, block, (cp.rank - step) % cp.size, cp, grad_q, grads,
                                   ctx.document_ids)
            if accumulator is not None:
                grads += accumulator.wait()
            accumulator = _Rotation(grads, cp, "cp ring dkv")
            if rotation is not None:
                block = rotation.wait()
        grad_k, grad_v = accumulator.wait()  # the last hop brings each rank its own block's gradients
        return grad_q.to(q.dtype), grad_k.to(k.dtype), grad_v.to(v.dtype), None, None
