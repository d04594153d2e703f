"""Where a linear's weight-gradient GEMM goes: into autograd, into a sink after the backward that makes
its operands (zero-bubble pipelines), or straight into a gradient accumulator (fused accumulation).

A zero-bubble schedule splits a chunk's backward in two: B, the gradient of the chunk's input, which
the previous stage waits for, and W, the weights' gradients, which nothing waits for and which fill
the bubble (Qi et al. 2023). As Megatron's WeightGradStore, the split is made inside the GEMMs: while
`deferring()` is on, a linear whose weight has a gradient sink (an FSDP unit's parameter view, which
adds it into the unit's fp32 accumulator) returns only its input gradient and queues the GEMM of its
weight gradient with the two operands it reads (its saved input and its output's gradient). `take()`
hands the queue of one B to its W, which runs it in order. Anything else (norm weights, embeddings,
modules that write their own weight gradients) gets its gradient in B as usual; work that must follow
every gradient of a unit (FSDP's reduction) is queued behind the unit's GEMMs (parallel/fsdp/hooks.py).

A sink that `fuses` (gradient accumulation fusion, as Megatron's) takes the GEMM in every backward,
deferred or not, and runs it into its accumulator: the step's first gradient is written by the GEMM
itself, later ones are added by it (beta = 1). Unfused, the GEMM makes a new tensor that is then
added: one allocation and one pass over the gradient more per weight and microbatch. Adding inside the
GEMM's sums may round differently from adding after them (in the last bits, from the second
microbatch on): a numerics experiment keeps the setting fixed. FSDP units fuse with fp32 compute only.
"""

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol

import torch
from torch import nn

Work = Callable[[], None]


class GradSink(Protocol):
    """Takes one weight's gradient in place of autograd."""

    fuses: bool  # take the GEMM in every backward, into the accumulator (else only a zero-bubble W's result)

    def add(self, grad: torch.Tensor) -> None:
        """Accumulate a computed gradient (the weight's shape)."""

    def add_product(self, grad_rows: torch.Tensor, input_rows: torch.Tensor) -> None:
        """Accumulate grad_rows^T @ input_rows (rows: tokens), the GEMM run into the accumulator."""


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


def is_deferring() -> bool:
    """Whether a zero-bubble step is running (its Ws run their GEMMs inside it, outside autograd)."""
    return _queue is not None


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


def set_sink(weight: torch.Tensor, sink: GradSink) -> None:
    """Where `weight`'s gradient goes when its linear does not return it to autograd."""
    setattr(weight, _SINK, sink)


def sink_of(weight: torch.Tensor) -> GradSink | None:
    return getattr(weight, _SINK, None)


def defer_weight_grad(sink: GradSink | None, compute: Callable[[], torch.Tensor]) -> bool:
    """From a linear's backward: defer `compute` (its weight-gradient GEMM) into the weight's sink (from
    sink_of at forward); False when not deferring or there is no sink: the backward returns the gradient."""
    return sink is not None and defer(lambda: sink.add(compute()))


def accumulate_product(out: torch.Tensor, grad_rows: torch.Tensor, input_rows: torch.Tensor, first: bool) -> None:
    """out = (first) or += (later) grad_rows^T @ input_rows, as one GEMM into `out`, whose dtype the operands
    share (a fusing sink has operands in its accumulator's dtype: torch has no mixed-dtype GEMM on CPU,
    and CUDA's, `out_dtype`, would skip the product's rounding to bf16, untested here without a GPU)."""
    if first:
        torch.mm(grad_rows.t(), input_rows, out=out)
    else:
        out.addmm_(grad_rows.t(), input_rows)


class DotGradSink:
    """A plain module's weight: its gradient accumulates into `.grad`, as autograd's would (for a runtime
    driving modules without FSDP units); `calls` counts the gradients it took."""

    def __init__(self, weight: torch.Tensor, fuses: bool):
        self.weight, self.fuses, self.calls = weight, fuses, 0

    def add(self, grad: torch.Tensor) -> None:
        self.calls += 1
        w = self.weight
        w.grad = grad if w.grad is None else w.grad.add_(grad)

    def add_product(self, grad_rows: torch.Tensor, input_rows: torch.Tensor) -> None:
        self.calls += 1
        w, first = self.weight, self.weight.grad is None
        if first:
            w.grad = torch.empty(w.shape, dtype=w.dtype, device=w.device)
        accumulate_product(w.grad, grad_rows, input_rows, first)


class _Linear(torch.autograd.Function):
    """x @ weight^T whose backward leaves the weight's gradient to its sink: now (fused) or in W."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.sink = sink_of(weight)
        return nn.functional.linear(x, weight)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        sink = ctx.sink
        grad_x = grad_out.matmul(weight)
        grad_rows, input_rows = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
        if sink.fuses:
            if not defer(lambda: sink.add_product(grad_rows, input_rows)):
                sink.add_product(grad_rows, input_rows)
            return grad_x, None

        def weight_grad() -> torch.Tensor:
            return grad_rows.t().mm(input_rows)

        if defer_weight_grad(sink, weight_grad):
            return grad_x, None
        return grad_x, weight_grad()


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """nn.functional.linear, whose weight gradient goes to the weight's sink: in a zero-bubble step, and
    in every backward where the sink fuses the accumulation."""
    sink = sink_of(weight)
    if sink is None or not torch.is_grad_enabled() or (_queue is None and not sink.fuses):
        return nn.functional.linear(x, weight)
    return _Linear.apply(x, weight)
