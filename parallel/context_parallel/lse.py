"""The attention core of context parallelism: attention over one block of keys that also returns its
log-sum-exp, and the merge of such partial results into the attention over all keys.

A rank's queries meet the sequence's keys block by block (all-gathered or ring-rotated, see
all_gather.py and ring.py), so each block's result is partial: blocks merge by their log-sum-exp in
fp32. The backward of a block takes the queries' FINAL output and log-sum-exp, which makes exp(s - lse)
that block's share of the whole softmax: blocks need no second pass. The core is a fused kernel that
returns the log-sum-exp, chosen by model.efficient_attn (kernels.py: torch's CPU flash kernel on CPU,
flash / memory-efficient / cuDNN on CUDA), or with `math` the plain formula in fp32
(tests/unit/parallel/test_cp_attention.py holds them together), run over blocks of query rows so that a
long chunk never holds more than SCORES_BUDGET fp32 scores at once.

With document ids (block-causal attention over packed documents) a query can see no key of a block at
all: its block result is 0 with log-sum-exp -inf, which the merge skips.
"""

import torch

from parallel.context_parallel.kernels import fused_backward, fused_forward, pair_kernel
from parallel.context_parallel.sharding import CPContext, chunk_pair_mask, visible_pairs

SEQ = 2  # of [batch, heads, seq, head_dim]
# fp32 attention scores (1 GiB) one block of query rows of the plain formula may hold: at 128k tokens
# over 4 ranks a chunk pair's whole score matrix would be tens of GiB per tensor.
SCORES_BUDGET = 2**28


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       allowed: torch.Tensor | None = None, kernel: str = "sdpa") -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T / sqrt(d)) v and the rows' log-sum-exp, both fp32; k/v have q's head count; `causal`
    (q and k the same tokens): each query sees the keys up to itself. `allowed` [b, s_q, s_k] bool
    (block_causal's documents, causality included) replaces `causal`; a query with no allowed key gets
    output 0 and log-sum-exp -inf, so merging it adds nothing. `kernel`: model.efficient_attn (kernels.py)."""
    fused = pair_kernel(kernel, q.device, q.dtype, allowed is not None)
    if fused == "math":
        return math_attention_with_lse(q, k, v, causal, allowed)
    out, lse = fused_forward(fused, q, k, v, causal and allowed is None, _additive(allowed, q.dtype))
    if allowed is not None:  # a kernel may give such a row a log-sum-exp of 0 (the CPU one does) and any output
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
                       lse: torch.Tensor, causal: bool, allowed: torch.Tensor | None = None, kernel: str = "sdpa"
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (fp32) of one query/key block, given the FINAL output and log-sum-exp of the queries
    over all blocks: the probabilities exp(s - lse) are then this block's share of the whole softmax."""
    fused = pair_kernel(kernel, q.device, q.dtype, allowed is not None)
    if fused == "math":
        return math_attention_backward(grad_out, q, k, v, out, lse, causal, allowed)
    grads = fused_backward(fused, grad_out.to(q.dtype), q, k, v, out.to(q.dtype), lse, causal and allowed is None,
                           _additive(allowed, q.dtype))
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


PROBE_TOKENS = 16


def pair_kernel_problem(kernel: str, device: torch.device, dtype: torch.dtype, heads: int, head_dim: int,
                        masked: bool) -> str | None:
    """Why the kernel a chunk pair runs (`kernel`: model.efficient_attn) fails for these shapes (per TP rank)
    on this device, forward or backward, unmasked and (`masked`: block_causal) masked; None if it runs.
    The pairs call torch's kernels themselves, without the public SDPA's fallback to another kernel and
    its padding of head_dim (flash takes head_dim up to 256, a multiple of 8, on sm80 and newer)."""
    q, k, v = (torch.randn(1, heads, PROBE_TOKENS, head_dim, device=device, dtype=dtype) for _ in range(3))
    causal = torch.ones(1, PROBE_TOKENS, PROBE_TOKENS, dtype=torch.bool, device=device).tril()
    for allowed in (None, causal) if masked else (None,):
        try:
            out, lse = attention_with_lse(q, k, v, True, allowed, kernel)
            attention_backward(torch.ones_like(out), q, k, v, out, lse, True, allowed, kernel)
        except RuntimeError as e:
            return f"{pair_kernel(kernel, device, dtype, allowed is not None)} kernel: {str(e).splitlines()[0]}"
    return None


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


# --- one rank's queries against one rank's block of keys -------------------------------------------
def empty_result(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The running out / lse before any block: output 0, log-sum-exp -inf."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    return out, torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)


def attend_block(q: torch.Tensor, block: torch.Tensor, holder: int, cp: CPContext, out: torch.Tensor,
                 lse: torch.Tensor, document_ids: torch.Tensor | None) -> None:
    """Merge the attention of q over `holder`'s [K; V] block into the running out / lse (in place)."""
    half, heads = q.shape[SEQ] // 2, q.shape[1]
    for qa, kb, q_chunk, k_chunk in visible_pairs(cp.rank, holder, cp.size):
        rows, cols, causal = slice(qa * half, (qa + 1) * half), slice(kb * half, (kb + 1) * half), q_chunk == k_chunk
        keys, values = (_expand_kv(t[:, :, cols], heads) for t in block)
        allowed = chunk_pair_mask(document_ids, q_chunk, k_chunk, half)
        part, part_lse = attention_with_lse(q[:, :, rows], keys, values, causal, allowed, cp.kernel)
        merged = torch.logaddexp(lse[:, :, rows], part_lse)
        base = merged.masked_fill(merged == float("-inf"), 0.0)  # a row no allowed key reached yet stays 0
        out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - base).unsqueeze(-1)
                           + part * torch.exp(part_lse - base).unsqueeze(-1))
        lse[:, :, rows] = merged
        cp.unmasked_pairs += half * (half + 1) // 2 if causal else half * half


def attend_block_backward(q: torch.Tensor, grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                          block: torch.Tensor, holder: int, cp: CPContext, grad_q: torch.Tensor,
                          grad_block: torch.Tensor, document_ids: torch.Tensor | None) -> None:
    """Add this block's share of dQ into grad_q and its dK/dV into grad_block (in place)."""
    half, heads, kv_heads = q.shape[SEQ] // 2, q.shape[1], block.shape[2]
    for qa, kb, q_chunk, k_chunk in visible_pairs(cp.rank, holder, cp.size):
        rows, cols = slice(qa * half, (qa + 1) * half), slice(kb * half, (kb + 1) * half)
        keys, values = (_expand_kv(t[:, :, cols], heads) for t in block)
        dq, dk, dv = attention_backward(grad_out[:, :, rows], q[:, :, rows], keys, values, out[:, :, rows],
                                        lse[:, :, rows], q_chunk == k_chunk,
                                        chunk_pair_mask(document_ids, q_chunk, k_chunk, half), cp.kernel)
        grad_q[:, :, rows] += dq
        grad_block[0][:, :, cols] += _sum_kv_groups(dk, kv_heads)
        grad_block[1][:, :, cols] += _sum_kv_groups(dv, kv_heads)

