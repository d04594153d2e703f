"""The block attention core of context parallelism: torch's CPU flash kernel and the plain fp32 formula
(the path other devices take) give the same output, log-sum-exp and block-wise gradients."""

import pytest
import torch

from parallel.context_parallel import (
    CPContext, attention_backward, attention_with_lse, math_attention_backward, math_attention_with_lse,
)
from parallel.context_parallel import lse as cp_lse


@pytest.mark.parametrize("causal", [True, False])
def test_flash_and_math_cores_agree_blockwise(causal: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8, generator=gen) for _ in range(3))
    grad_out = torch.randn(2, 4, 16, 8, generator=gen)
    for core in (attention_with_lse, math_attention_with_lse):
        out, lse = core(q, k, v, causal)
        reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-6)
    flash_out, flash_lse = attention_with_lse(q, k, v, causal)
    math_out, math_lse = math_attention_with_lse(q, k, v, causal)
    torch.testing.assert_close(flash_lse, math_lse, rtol=1e-5, atol=1e-5)
    # Keys in two blocks, gradients per block from the final output and log-sum-exp: they add up to
    # the gradients of attention over both blocks.
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal).backward(grad_out)
    for backward in (attention_backward, math_attention_backward):
        if causal:  # one block: the whole triangle
            dq, dk, dv = backward(grad_out, q, k, v, flash_out, flash_lse, True)
        else:
            first = backward(grad_out, q, k[:, :, :8], v[:, :, :8], math_out, math_lse, False)
            second = backward(grad_out, q, k[:, :, 8:], v[:, :, 8:], math_out, math_lse, False)
            dq = first[0] + second[0]
            dk, dv = (torch.cat([a, b], dim=2) for a, b in zip(first[1:], second[1:]))
        for got, want in zip((dq, dk, dv), (qq.grad, kk.grad, vv.grad)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_flash_and_math_cores_agree_under_a_document_mask_with_rows_that_see_no_key() -> None:
    """block_causal under CP: a chunk pair where some queries share no document with any key. Those rows
    must come back as output 0 and log-sum-exp -inf (the CPU kernel itself reports 0), so that merging
    the block adds nothing; the others match SDPA with the same mask, and so do the gradients."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 4, 8, 8, generator=gen) for _ in range(3))
    grad_out = torch.randn(2, 4, 8, 8, generator=gen)
    query_docs = torch.tensor([[0, 0, 1, 1, 2, 2, 2, 3], [5, 5, 5, 5, 5, 5, 5, 5]])
    key_docs = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2], [5, 5, 5, 5, 6, 6, 6, 6]])
    allowed = query_docs[:, :, None] == key_docs[:, None, :]
    blind = ~allowed.any(-1)  # row 0: the query of document 3 sees nothing
    assert blind.sum() == 1
    reference = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
    results = [core(q, k, v, False, allowed) for core in (attention_with_lse, math_attention_with_lse)]
    for out, lse in results:
        assert torch.isinf(lse[blind[:, None].expand_as(lse)]).all() and (lse[blind[:, None].expand_as(lse)] < 0).all()
        assert (out.masked_select(blind[:, None, :, None]) == 0).all() and torch.isfinite(out).all()
        seen = ~blind[:, None, :, None].expand_as(out)
        torch.testing.assert_close(out[seen], reference[seen], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-5, atol=1e-5)
    # Gradients through the final output (here this one block): SDPA's, rows that see nothing aside.
    out, lse = results[1]
    visible = ~blind
    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
    masked_ref = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=allowed[:, None])
    (masked_ref * visible[:, None, :, None]).backward(grad_out)
    for backward in (attention_backward, math_attention_backward):
        grads = backward(grad_out * visible[:, None, :, None], q, k, v, out, lse.masked_fill(blind[:, None], 0.0),
                         False, allowed)
        for got, want in zip(grads, (qq.grad, kk.grad, vv.grad)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mask", ["causal", "documents"])
def test_the_plain_formula_over_blocks_of_query_rows_equals_it_in_one_block(mask: str, monkeypatch) -> None:
    """A long chunk runs the plain formula over blocks of query rows (SCORES_BUDGET): same output,
    log-sum-exp and gradients as one block, with the causal diagonal and document masks cut across
    the blocks."""
    gen = torch.Generator().manual_seed(2)
    q, k, v, grad_out = (torch.randn(2, 4, 12, 8, generator=gen) for _ in range(4))
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 2 + [1] * 4 + [2] * 6])
    allowed = (docs[:, :, None] == docs[:, None, :]).tril() if mask == "documents" else None
    whole = math_attention_with_lse(q, k, v, True, allowed)
    whole_grads = math_attention_backward(grad_out, q, k, v, *whole, True, allowed)
    monkeypatch.setattr(cp_lse, "SCORES_BUDGET", 2 * 4 * 12 * 5)  # blocks of 5, 5 and 2 rows
    assert [(s.start, s.stop) for s in cp_lse._row_blocks(q, k)] == [(0, 5), (5, 10), (10, 12)]
    blocked = math_attention_with_lse(q, k, v, True, allowed)
    blocked_grads = math_attention_backward(grad_out, q, k, v, *blocked, True, allowed)
    for got, want in zip((*blocked, *blocked_grads), (*whole, *whole_grads)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=allowed[:, None] if allowed is not None else None, is_causal=allowed is None)
    torch.testing.assert_close(blocked[0], reference, rtol=1e-5, atol=1e-6)


class _FirstOfTwoRanks(CPContext):
    size, rank = 2, 0  # in place of a process group's


def test_a_sequence_that_does_not_split_into_equal_chunks_is_refused() -> None:
    """Uneven chunks would hold other tokens than their rotary positions say (seq 10 over 2 ranks: rank 0
    would hold tokens 0, 1, 2, 9 at positions 0, 1, 6, 7)."""
    cp = _FirstOfTwoRanks()
    torch.testing.assert_close(cp.shard(torch.arange(12)[None]), torch.tensor([[0, 1, 2, 9, 10, 11]]))
    with pytest.raises(ValueError, match="a sequence dimension of 10 does not split into 4 equal chunks"):
        cp.shard(torch.arange(10)[None])
    with pytest.raises(ValueError, match="a sequence dimension of 5 does not split into 2 equal chunks"):
        cp.positions(5, torch.device("cpu"))
