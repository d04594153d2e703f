"""Regional compilation (`compile=true`): each transformer block's forward is compiled on its own, as
torchtitan does it, not the whole model. Every block runs the same code, so one compiled graph serves
all of them (dynamo lifts a module's tensors to graph inputs instead of specializing on them).

`compile_forward` replaces the module's `forward`, as activation checkpointing's wrapper does: the
module's own hooks (an FSDP unit's pre/post-forward, which gather, install parameter views and reshard)
run outside the compiled region, and the views they install are plain graph inputs, so a new gather
(ZeRO-3 makes new views every microbatch) reuses the graph. Applied after activation checkpointing,
the checkpoint is traced into the graph (its recompute is compiled too).

What dynamo cannot trace runs eagerly between compiled pieces, marked with `eager_region`: the
collectives of TP/SP and CP (process groups, the comm ledger) and the fp8 GEMM (host-side state that
changes between microbatches and steps would be guarded on and recompile).

`CompileStats` counts the graphs dynamo hands the backend and the seconds compiling took (inductor's
caches can make a compile cheap, never uncounted); a graph compiled after step 1 is a recompilation.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import nn

F = TypeVar("F", bound=Callable)


def eager_region(fn: F) -> F:
    """`fn` runs eagerly, a graph break inside a compiled region (no-op outside one)."""
    return torch.compiler.disable(fn, recursive=True)


@dataclass
class CompileStats:
    graphs: int = 0  # dynamo graphs handed to the backend (each compile or recompile of a region)
    seconds: float = 0.0  # in the backend, and compiling backward graphs (at the first backward)

    def summary(self) -> str:
        breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
        return (f"compile: {self.graphs} graphs compiled in {self.seconds:.1f} s ({breaks} graph breaks, where the "
                f"collectives and fp8 GEMMs run eagerly)")


STATS = CompileStats()


def _timed_inner_compile(*args, **kwargs):
    from torch._inductor.compile_fx import compile_fx_inner

    start = time.perf_counter()
    try:
        return compile_fx_inner(*args, **kwargs)
    finally:
        # Backward graphs compile at the first backward, outside `_backend`'s timer.
        if not _in_backend:
            STATS.seconds += time.perf_counter() - start


_in_backend = False


def _backend(gm: torch.fx.GraphModule, example_inputs: list) -> Callable:
    """Inductor, counted and timed."""
    from torch._inductor.compile_fx import compile_fx

    global _in_backend
    STATS.graphs += 1
    start, _in_backend = time.perf_counter(), True
    try:
        return compile_fx(gm, example_inputs, inner_compile=_timed_inner_compile)
    finally:
        _in_backend = False
        STATS.seconds += time.perf_counter() - start


def reset_compilation() -> None:
    """Forget every compiled graph and the counts: a model built anew compiles anew."""
    torch._dynamo.reset()
    STATS.graphs = 0
    STATS.seconds = 0.0


def compile_forward(module: nn.Module) -> None:
    """Compile the module's forward (whatever wraps it already, e.g. a checkpoint), hooks left outside."""
    module.forward = torch.compile(module.forward, backend=_backend)
