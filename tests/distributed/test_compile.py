"""compile=true (regional compilation, inductor's C++ backend) on 2 gloo ranks, one launch for every layout:
tp2 with SP and full checkpointing, pp2 1F1B and interleaved, cp2 ring with selective checkpointing,
ZeRO-3 with full checkpointing (four microbatches whose parameter views are new every microbatch, cut and
connected by optimize_backward_concat), ZeRO-2 with selective checkpointing, and fp8 with the fp8
all-gather. Each against the same layout in eager mode: every step's loss within 1e-4 relative over 10
steps; every graph compiled during step 1 and none after (steps 2-10 reuse them); layouts without an
eager region in their blocks compile exactly ONE graph for all blocks. Then deterministic mode: two
runs compiled from scratch (inductor's caches off) are bitwise equal."""

import torch
from torch._dynamo.utils import counters

from parallel.regional_compile import STATS
from tests.distributed.pipeline_cases import config, make_trainer
from tests.distributed.spawn import run_ranks
from trainer.determinism import enable_deterministic

STEPS = 10
REL = 1e-4
SMALL = {"n_layers": 2}
FP8 = {"n_layers": 2, "dim": 32, "n_heads": 2, "n_kv_heads": 2, "use_fp8": True, "fp8_all_gather": True}

# (label, config overrides, whether every block compiles to one graph: no collective or fp8 GEMM inside)
LAYOUTS = [
    ("tp2 sp, ac full", dict(model=SMALL | {"sequence_parallel": True, "layer_ckpt": "full"},
                             model_parallel_size=2, batch_size=2), False),
    ("pp2 1f1b", dict(model={"n_layers": 4}, pipeline_parallel_size=2, batch_size=4), True),
    ("pp2 interleaved", dict(model={"n_layers": 4}, pipeline_parallel_size=2, pipeline_schedule="interleaved_1f1b",
                             num_layers_per_virtual_pipeline_stage=1, batch_size=4), True),
    ("cp2 ring, ac selective", dict(model=SMALL | {"layer_ckpt": "selective"}, context_parallel_size=2,
                                    context_parallel_comm="ring", batch_size=2), False),
    ("zero3, ac full", dict(model=SMALL | {"layer_ckpt": "full"}, batch_size=4, optimize_backward_concat=True), True),
    ("zero2, ac selective", dict(model=SMALL | {"layer_ckpt": "selective"}, batch_size=4,
                                 reshard_after_forward=False), True),
    ("fp8, fp8 all-gather", dict(model=FP8, batch_size=4, microbatch_size=2), False),
]


def _losses(cfg, world: int) -> tuple[list[float], int]:
    """The losses of STEPS steps, and the graphs compiled by the end of step 1 (checked unchanged after)."""
    trainer = make_trainer(cfg, world)
    losses = [trainer.train_step(1).loss]
    after_first = STATS.graphs
    losses += [trainer.train_step(step).loss for step in range(2, STEPS + 1)]
    assert STATS.graphs == after_first, f"recompiled after step 1: {after_first} -> {STATS.graphs} graphs"
    return losses, after_first


def _check_layouts(rank: int, world: int) -> None:
    for label, overrides, one_graph in LAYOUTS:
        eager, _ = _losses(config(steps=STEPS, **overrides), world)
        counters.clear()
        compiled, graphs = _losses(config(steps=STEPS, compile=True, **overrides), world)
        assert graphs == 1 if one_graph else graphs > 1, (label, graphs)
        if not one_graph:  # the eager regions are graph breaks, not a fallback of whole blocks to eager
            assert sum(counters["graph_break"].values()) > 0, label
        for step, (a, b) in enumerate(zip(compiled, eager, strict=True), 1):
            assert abs(a - b) <= REL * abs(b), f"{label} step {step}: compiled {a} vs eager {b}"


def _check_deterministic(rank: int, world: int) -> None:
    enable_deterministic("cpu")
    cfg = config(steps=STEPS, compile=True, enable_deterministic_training=True,
                 **dict(model=SMALL | {"layer_ckpt": "selective"}, batch_size=4))
    with torch._inductor.config.patch(fx_graph_cache=False, autotune_local_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        runs = [_losses(cfg, world)[0] for _ in range(2)]
    assert runs[0] == runs[1], runs


def _run(rank: int, world: int) -> None:
    _check_layouts(rank, world)
    _check_deterministic(rank, world)


def test_compile_on_two_ranks():
    run_ranks(2, _run)
