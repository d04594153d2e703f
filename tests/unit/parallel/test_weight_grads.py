"""Deferred weight gradients (parallel/weight_grads.py): what B leaves to W, and what it does not."""

import pytest
import torch

from parallel import weight_grads


def _operands():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 4, generator=gen, requires_grad=True)
    weight = torch.randn(5, 4, generator=gen, requires_grad=True)
    grad_out = torch.randn(2, 3, 5, generator=gen)
    return x, weight, grad_out


def test_b_computes_the_input_gradient_and_w_the_weights_into_the_sink():
    x, weight, grad_out = _operands()
    torch.nn.functional.linear(x, weight).backward(grad_out)
    want_x, want_w = x.grad.clone(), weight.grad.clone()
    x.grad = weight.grad = None

    sunk = []
    view = weight * 1.0  # a non-leaf standing for an FSDP parameter view
    weight_grads.set_sink(view, sunk.append)
    with weight_grads.deferring():
        weight_grads.linear(x, view).backward(grad_out)
        assert weight.grad is None and not sunk  # B: the weight's GEMM is only queued
        torch.testing.assert_close(x.grad, want_x, rtol=1e-6, atol=1e-6)
        (work,) = weight_grads.take()
        assert weight_grads.take() == []
        with torch.no_grad():
            work()
    assert len(sunk) == 1 and weight.grad is None  # W: straight into the sink, never through autograd
    torch.testing.assert_close(sunk[0], want_w, rtol=1e-6, atol=1e-6)


def test_outside_a_zero_bubble_step_nothing_is_deferred():
    x, weight, grad_out = _operands()
    weight_grads.set_sink(weight, lambda grad: pytest.fail("sunk outside deferring()"))
    y = weight_grads.linear(x, weight)
    assert y.grad_fn.name() != "_LinearBackward"  # the plain linear: bits as before
    y.backward(grad_out)
    assert weight.grad is not None
    assert not weight_grads.defer(lambda: None)
    with weight_grads.deferring():  # a weight without a sink keeps its gradient in B
        plain = torch.randn(5, 4, requires_grad=True)
        weight_grads.linear(x, plain).backward(grad_out)
        assert plain.grad is not None and weight_grads.take() == []
        with pytest.raises(RuntimeError, match="nested"), weight_grads.deferring():
            pass
