"""Weight gradients computed after the backward that makes their operands (zero-bubble pipelines).

A zero-bubble schedule splits a chunk's backward in two: B, the gradient of the chunk's input, which
the previous stage waits for, and W, the weights' gradients, which nothing waits for and which fill
the bubble (Qi et al. 2023). As Megatron's WeightGradStore, the split is made inside the GEMMs: while
`deferring()` is on, a linear whose weight has a gradient sink (an FSDP unit's parameter view, which
adds it into the unit's fp32 accumulator) returns only its input gradient and queues the GEMM of its
weight gradient with the two operands it reads (its saved input and its output's gradient). `take()`
hands the queue of one B to its W, which runs it in order. Anything else (norm weights, embeddings,
modules that write their own weight gradients) gets its gradient in B as usual; work that must follow
every gradient of a unit (FSDP's reduction) is queued behind the unit's GEMMs (parallel/fsdp/hooks.py).
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

Sink = Callable[[torch.Tensor], None]  # receives one weight's gradient (compute dtype, the weight's shape)
Work = Callable[[], None]

_SINK = "weight_grad_sink"
_queue: list[Work] | None = None  # while deferring: the current backward's deferred work


@contextmanager
def deferring() -> Iterator[None]:
    """Over a zero-bubble step: linears with a sink defer their weight gradients, as may `defer` users."""
    global _queue
    if _queue is not None:
        raise RuntimeError("weight gradients are already being deferred (nested deferring())")
    _queue = []
    try:
        yield
    finally:
        _queue = None


def defer(work: Work) -> bool:
    """Queue `work` for the running backward's W: True when deferring, else False (the caller runs it)."""
    if _queue is None:
        return False
    _queue.append(work)
    return True


def take() -> list[Work]:
    """The work deferred since the last take: one B's, for its W."""
    if _queue is None:
        raise RuntimeError("take() outside deferring()")
    work = list(_queue)
    _queue.clear()
    return work


def set_sink(weight: torch.Tensor, sink: Sink) -> None:
    """Where `weight`'s gradient goes when its GEMM is deferred (it bypasses autograd)."""
    setattr(weight, _SINK, sink)


def sink_of(weight: torch.Tensor) -> Sink | None:
    return getattr(weight, _SINK, None)


def defer_weight_grad(sink: Sink | None, compute: Callable[[], torch.Tensor]) -> bool:
    """From a linear's backward: defer `compute` (its weight-gradient GEMM) into the weight's sink (from
    sink_of at forward); False when not deferring or there is no sink: the backward returns the gradient."""
    return sink is not None and defer(lambda: sink(compute()))


class _Linear(torch.autograd.Function):
    """x @ weight^T whose backward may leave the weight's gradient to W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.sink = sink_of(weight)
        return nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_x = grad_out.matmul(weight)

        def weight_grad() -> torch.Tensor:
            return grad_out.reshape(-1, grad_out.shape[-1]).t().mm(x.reshape(-1, x.shape[-1]))

        if defer_weight_grad(ctx.sink, weight_grad):
            return grad_x, None
        return grad_x, weight_grad()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """nn.functional.linear, whose weight gradient is deferred to W in a zero-bubble step."""
    if _queue is None or sink_of(weight) is None:
        return nn.functional.linear(x, weight)
    return _Linear.apply(x, weight)
