"""Weight gradients that bypass autograd (parallel/weight_grads.py): what a zero-bubble B leaves to W,
what it does not, and fused accumulation, whose GEMM runs into the accumulator in every backward."""

import pytest
import torch

from parallel import weight_grads


def _operands(tokens: int = 3):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, tokens, 4, generator=gen, requires_grad=True)
    weight = torch.randn(5, 4, generator=gen, requires_grad=True)
    grad_out = torch.randn(2, tokens, 5, generator=gen)
    return x, weight, grad_out


class _Recorder:
    """A sink that keeps what it is given."""

    def __init__(self, fuses: bool):
        self.fuses, self.added, self.products = fuses, [], []

    def add(self, grad):
        self.added.append(grad)

    def add_product(self, grad_rows, input_rows):
        self.products.append(grad_rows.t() @ input_rows)


def test_b_computes_the_input_gradient_and_w_the_weights_into_the_sink():
    x, weight, grad_out = _operands()
    torch.nn.functional.linear(x, weight).backward(grad_out)
    want_x, want_w = x.grad.clone(), weight.grad.clone()
    for fuses in (False, True):
        x.grad = weight.grad = None
        sink = _Recorder(fuses)
        view = weight * 1.0  # a non-leaf standing for an FSDP parameter view
        weight_grads.set_sink(view, sink)
        with weight_grads.deferring():
            weight_grads.linear(x, view).backward(grad_out)
            assert weight.grad is None and not sink.added and not sink.products  # B: the GEMM is only queued
            torch.testing.assert_close(x.grad, want_x, rtol=1e-6, atol=1e-6)
            (work,) = weight_grads.take()
            assert weight_grads.take() == []
            with torch.no_grad():
                work()
        # W: straight into the sink, never through autograd; a fusing sink runs the GEMM itself
        assert weight.grad is None and len(sink.added) == (not fuses) and len(sink.products) == fuses
        torch.testing.assert_close((sink.products or sink.added)[0], want_w, rtol=1e-6, atol=1e-6)


def test_outside_a_zero_bubble_step_a_sink_that_does_not_fuse_is_left_alone():
    x, weight, grad_out = _operands()
    sink = _Recorder(fuses=False)
    weight_grads.set_sink(weight, sink)
    y = weight_grads.linear(x, weight)
    assert y.grad_fn.name() != "_LinearBackward"  # the plain linear: bits as before
    y.backward(grad_out)
    assert weight.grad is not None and not sink.added and not sink.products
    assert not weight_grads.defer(lambda: None)
    with weight_grads.deferring():  # a weight without a sink keeps its gradient in B
        plain = torch.randn(5, 4, requires_grad=True)
        weight_grads.linear(x, plain).backward(grad_out)
        assert plain.grad is not None and weight_grads.take() == []
        with pytest.raises(RuntimeError, match="nested"), weight_grads.deferring():
            pass


def test_a_fusing_sink_takes_the_gemm_in_an_ordinary_backward_but_not_under_no_grad():
    x, weight, grad_out = _operands()
    sink = _Recorder(fuses=True)
    view = weight * 1.0
    weight_grads.set_sink(view, sink)
    weight_grads.linear(x, view).backward(grad_out)
    assert weight.grad is None and len(sink.products) == 1
    torch.testing.assert_close(sink.products[0], grad_out.reshape(-1, 5).t() @ x.reshape(-1, 4), rtol=0, atol=0)
    with torch.no_grad():
        assert weight_grads.linear(x, view).grad_fn is None


@pytest.mark.parametrize("tokens", [3, 700])  # 2 x 700 rows: past where the CPU GEMM splits its inner dimension
def test_dot_grad_sink_accumulates_as_autograd_does(tokens):
    """First microbatch: the GEMM writes .grad, the bits of autograd's own. Later: one GEMM adding into
    it, against autograd's product-then-add within rounding (where the add falls in the GEMM's sums)."""
    x, weight, grad_out = _operands(tokens)
    fused = weight.detach().clone().requires_grad_()
    sink = weight_grads.DotGradSink(fused, fuses=True)
    weight_grads.set_sink(fused, sink)
    for mb in range(3):
        g = grad_out * (mb + 1)
        torch.nn.functional.linear(x, weight).backward(g)
        weight_grads.linear(x, fused).backward(g)
        if mb == 0:
            assert torch.equal(fused.grad, weight.grad)
    assert sink.calls == 3
    torch.testing.assert_close(fused.grad, weight.grad, rtol=1e-5, atol=1e-3)  # sums of 2 x 700 products

