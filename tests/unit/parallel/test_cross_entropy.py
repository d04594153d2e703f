"""The cross-entropy at tp=1 against F.cross_entropy, in fp32 and from bf16 logits; a padded
vocabulary's loss and gradient are the unpadded vocabulary's, none into the padding columns, and a
padding id is no target; the backward works in place on what the forward saved, so a second backward
through the graph raises. (tp > 1, where the padding falls on the last ranks:
tests/distributed/test_tensor_parallel.py.)"""

import pytest
import torch
import torch.nn.functional as F

from parallel.cross_entropy import IGNORE_INDEX, vocab_parallel_cross_entropy
from parallel.tensor_parallel import TPContext

REAL, PADDED = 40, 64


def test_the_padding_columns_are_masked_out_of_the_loss_and_its_gradient():
    gen = torch.Generator().manual_seed(0)
    real = torch.randn(2, 5, REAL, generator=gen)
    # Far above the real logits: unmasked, the padding would take almost all the probability.
    padded = torch.cat([real, torch.full((2, 5, PADDED - REAL), 50.0)], -1).requires_grad_()
    unpadded = real.clone().requires_grad_()
    targets = torch.randint(0, REAL, (2, 5), generator=gen)
    targets[0, 0] = IGNORE_INDEX
    loss = vocab_parallel_cross_entropy(padded, targets, TPContext(), valid_vocab_size=REAL)
    expected = vocab_parallel_cross_entropy(unpadded, targets, TPContext())
    assert torch.equal(loss, expected)
    loss.sum().backward()
    expected.sum().backward()
    assert torch.equal(padded.grad[..., :REAL], unpadded.grad)
    assert not padded.grad[..., REAL:].any()


def test_a_padding_id_is_no_target():
    """As an id out of the vocabulary, at every tp: NaN, which halts training."""
    loss = vocab_parallel_cross_entropy(torch.zeros(3, PADDED), torch.tensor([0, REAL, 1]), TPContext(), REAL)
    assert loss[1].isnan() and loss[[0, 2]].isfinite().all(), loss


@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-6)])
def test_loss_and_gradient_are_f_cross_entropys_over_the_fp32_logits(dtype, rtol):
    gen = torch.Generator().manual_seed(1)
    logits = (4 * torch.randn(2, 7, 300, generator=gen)).to(dtype)
    targets = torch.randint(0, 300, (2, 7), generator=gen)
    targets[1, 3] = IGNORE_INDEX
    ours_in, ref_in = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(ours_in, targets, TPContext())
    ref = F.cross_entropy(ref_in.float().flatten(0, 1), targets.flatten(), reduction="none").view(2, 7)
    assert torch.allclose(loss, ref, rtol=rtol, atol=0) and loss[1, 3] == 0, (loss - ref).abs().max()
    scale = torch.linspace(0.5, 2.0, 14).view(2, 7)  # a per-token upstream gradient, not just ones
    (loss * scale).sum().backward()
    (ref * scale).sum().backward()
    assert ours_in.grad.dtype == dtype and not ours_in.grad[1, 3].any()
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # bf16: the gradients' own rounding
    assert torch.allclose(ours_in.grad.float(), ref_in.grad.float(), rtol=tol, atol=1e-7)


def test_the_logits_are_left_as_they_were():
    logits = torch.randn(4, 50, requires_grad=True)
    before = logits.detach().clone()
    vocab_parallel_cross_entropy(logits, torch.arange(4), TPContext(), 40).sum().backward()
    assert torch.equal(logits.detach(), before) and logits._version == 0


def test_permuted_logits_are_read_as_they_are():
    logits = torch.randn(5, 2, 50).transpose(0, 1).requires_grad_()
    targets = torch.randint(0, 50, (2, 5))
    loss = vocab_parallel_cross_entropy(logits, targets, TPContext())
    reference = logits.detach().clone().requires_grad_()
    expected = F.cross_entropy(reference.flatten(0, 1), targets.flatten(), reduction="none").view(2, 5)
    assert torch.allclose(loss, expected, rtol=1e-6)
    loss.sum().backward()
    expected.sum().backward()
    assert torch.allclose(logits.grad, reference.grad, rtol=1e-6, atol=1e-7)


def test_a_second_backward_through_the_same_graph_raises():
    """The backward turns the saved softmax into the gradient in place: reading it again must fail."""
    logits = torch.randn(4, 50, requires_grad=True)
    loss = vocab_parallel_cross_entropy(logits, torch.arange(4), TPContext()).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
