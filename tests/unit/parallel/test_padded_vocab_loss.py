"""The vocab-parallel cross-entropy of a padded vocabulary at tp=1: the unpadded vocabulary's loss and
gradient, none into the padding columns, and a padding id is no target. (tp > 1, where the padding
falls on the last ranks: tests/distributed/test_tensor_parallel.py.)"""

import pytest
import torch

from parallel.tensor_parallel import IGNORE_INDEX, TPContext, vocab_parallel_cross_entropy

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
    """As an id out of the vocabulary: tp=1 raises (F.cross_entropy), tp > 1 gives NaN."""
    with pytest.raises(IndexError, match=f"Target {REAL} is out of bounds"):
        vocab_parallel_cross_entropy(torch.zeros(3, PADDED), torch.tensor([0, REAL, 1]), TPContext(), REAL)
