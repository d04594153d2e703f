"""The memory model's buffers beyond the saved activations, each against the code run for real on CPU:
the loss's scratch, a zero-bubble W's deferred operands, the fp8 weight casts; and the step's program
walked with its steady state skipped against the same program walked action by action."""

import gc
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from model.fp8 import Fp8Gemm
from model.transformer import Transformer, TransformerBlock
from parallel import weight_grads
from parallel.cross_entropy import vocab_parallel_cross_entropy
from parallel.pipeline.schedule import BACKWARD, WEIGHT, pipeline_actions
from parallel.tensor_parallel import TPContext
from planner import fake_world, memory
from planner.activations import ActivationKey, sequence_activations
from planner.config import compose_config
from planner.deferred_grads import sequence_deferred
from planner.dry_run import plan
from planner.memory import ShardingPlan, UnitPlan, compute_steps, peak_memory
from planner.rank_plan import fp8_state_bytes
from trainer.config.rules import validate

SEQ = 128


class _LiveByAddress(TorchDispatchMode):
    """Live bytes of real storages, by address, and their peak since `reset`."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.sizes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and (ptr := t.untyped_storage().data_ptr()) not in self.sizes:
                self.sizes[ptr] = t.untyped_storage().nbytes()
                self.live += self.sizes[ptr]
                self.peak = max(self.peak, self.live)
                weakref.finalize(t.untyped_storage(), self._free, ptr)
        return out

    def _free(self, ptr: int) -> None:
        self.live -= self.sizes.pop(ptr, 0)

    def reset(self) -> None:
        self.peak = self.live


def _measured_loss_scratch(tp: TPContext, vocab: int, dtype: torch.dtype) -> tuple[int, int]:
    """(forward peak, backward peak) over what the loss leaves saved, of the trainer's loss on CPU: logits
    from a head, dropped once the loss has them (as the pipeline runtime does), backward to the logits."""
    h = torch.randn(1, SEQ, 16, dtype=dtype, requires_grad=True)
    w = torch.randn(vocab // tp.size, 16, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, vocab // tp.size, (1, SEQ))
    live, backward_peak = _LiveByAddress(), []
    with live:
        logits = h @ w.t()
        live.reset()
        loss = vocab_parallel_cross_entropy(logits, targets, tp).sum()
        logits.register_hook(lambda grad: backward_peak.append(live.peak))
        del logits
        forward_peak, left = live.peak, live.live
        live.reset()
        loss.backward()
    return forward_peak - left, backward_peak[0] - left


@pytest.mark.parametrize("tp, dtype, multiples", [(1, torch.bfloat16, (0.5, 0.5)), (2, torch.bfloat16, (0.5, 0.5)),
                                                  (1, torch.float32, (1.0, 0.0))])
def test_the_loss_scratch_is_what_the_loss_holds_on_cpu(tp, dtype, multiples):
    """With S the fp32 logits' bytes: the loss holds the logits (S/2 in bf16) beside the one fp32 copy it
    makes and saves as the softmax; its backward makes that copy the gradient in place, and only bf16
    logits need a (bf16) copy of it. (F.cross_entropy held 1.5 S beyond its saved S forward and 2 S in
    backward; the vocab-parallel loss before this one 2.5 S and 2 S.)"""
    cfg = compose_config(["model=small", f"seq_len={SEQ}", f"model_parallel_size={tp}"])
    traced = sequence_activations(ActivationKey(cfg.model, tp, 1, False, "all_gather", SEQ, dtype))
    with fake_world.started():
        measured = _measured_loss_scratch(fake_world.tp_context(tp, False), cfg.model.vocab_size, dtype)
    assert (traced.loss_forward, traced.loss_backward) == pytest.approx(measured, rel=1e-3)
    s = SEQ * cfg.model.vocab_size // tp * 4
    assert (traced.loss_forward / s, traced.loss_backward / s) == pytest.approx(multiples, rel=1e-2, abs=1e-2)


def test_the_loss_scratch_is_on_the_head_stage_peak_only():
    """Logits large enough for the loss's scratch (their fp32 bytes) to make the head stage's peak, over the
    head's parameter gradients handed to its accumulator."""
    seq = 1024
    cfg = compose_config(["model=small", f"seq_len={seq}", "compute_dtype=fp32", "pipeline_parallel_size=2",
                          "batch_size=4", "dry_run=true", "world_size=2", "model.vocab_size=65536"])
    stages = plan(cfg, validate(cfg, 2))["memory"]["per_stage"]
    traced = sequence_activations(ActivationKey(cfg.model, 1, 1, False, "all_gather", seq, torch.float32))
    assert stages[0]["categories"]["loss_buffers"] == 0
    assert stages[1]["categories"]["loss_buffers"] in (traced.loss_forward, traced.loss_backward)


def test_deferred_weight_gradients_hold_what_a_zero_bubble_b_leaves_on_cpu():
    """A zero-bubble B on CPU, every weight with a sink: the bytes only its queued W keeps alive (freed
    when the queue goes) against the trace's operands of two blocks and the head."""
    cfg = compose_config(["model=small", f"seq_len={SEQ}"])
    traced = sequence_deferred(ActivationKey(cfg.model, 1, 1, False, "all_gather", SEQ, torch.float32))
    model = Transformer(cfg.model, TPContext(), range(2))
    for p in model.parameters():
        weight_grads.set_sink(p, weight_grads.DotGradSink(p, fuses=False))
    tokens = torch.randint(0, cfg.model.vocab_size, (1, SEQ))
    live = _LiveByAddress()
    with weight_grads.deferring(), live:
        vocab_parallel_cross_entropy(model(tokens), tokens, TPContext()).sum().backward()
        work = weight_grads.take()
        held = live.live
        del work
        gc.collect()
        held -= live.live
    assert held == 2 * traced.block + traced.head > 0


def _program_peak(schedule: str, pp: int, rank: int, microbatches: int, unit: UnitPlan) -> dict:
    steps = compute_steps(pipeline_actions(schedule, pp, 1, microbatches)[rank])
    return peak_memory(steps, [[unit]], ShardingPlan(1, 4, False, False, 0, 0))[0]


@pytest.mark.parametrize("schedule", ["zb_h1", "1f1b"])
def test_a_zero_bubble_w_frees_what_its_b_deferred(schedule):
    """Operands only: the peak holds them for every B whose W has not run, counted off the program; a
    program without W holds none."""
    pp, rank, microbatches = 4, 3, 8  # the last rank defers the most: pp Bs before their Ws
    peak = _program_peak(schedule, pp, rank, microbatches, UnitPlan(numel=8, activation=0, deferred=1000))
    pending = most = 0
    for a in pipeline_actions(schedule, pp, 1, microbatches)[rank]:
        pending += (a.op == BACKWARD) - (a.op == WEIGHT)
        most = max(most, pending)
    assert peak["deferred_weight_grads"] == (1000 * most if schedule == "zb_h1" else 0)
    assert schedule == "1f1b" or most > 1


def _walked(steps: tuple, chunks: list, plan: ShardingPlan) -> tuple[dict, dict]:
    """The program action by action, nothing skipped."""
    state = memory._State(chunks, plan)
    defers = any(op == WEIGHT for op, _, _ in steps)
    for step in steps:
        state.run(*step, defers)
    return state.peak, state.measured


@pytest.mark.parametrize("schedule, pp, vpp, microbatches", [("1f1b", 4, 2, 13), ("1f1b", 4, 1, 40), ("1f1b", 2, 4, 9),
                                                             ("zb_h1", 4, 1, 23), ("zbv", 4, 2, 29)])
@pytest.mark.parametrize("reshard, per_microbatch", [(False, False), (True, True)])
def test_skipping_the_steady_state_finds_the_peak_of_the_whole_program(schedule, pp, vpp, microbatches, reshard,
                                                                      per_microbatch):
    units = [UnitPlan(100, 7, deferred=3), UnitPlan(300, 5, deferred=2), UnitPlan(200, 11, 13, 17, 19, 23)]
    chunks = [units[:2], units[1:]] * (vpp // 2) if vpp > 1 else [units]
    plan = ShardingPlan(4, 2, reshard, per_microbatch, 2, 1)
    for rank in range(pp):
        steps = compute_steps(pipeline_actions(schedule, pp, vpp, microbatches)[rank])
        assert peak_memory(steps, chunks, plan) == _walked(steps, chunks, plan)


@pytest.mark.parametrize("all_gather", [False, True])
def test_fp8_state_counts_the_weight_casts_the_gemms_keep(all_gather):
    """A block's fp8 GEMMs run for real on CPU, marked as a step's first microbatch: the scaling buffers
    and the casts they keep for the step's other microbatches (none when FSDP gathers fp8 weights)."""
    cfg = compose_config(["model=small", "model.use_fp8=true", f"model.fp8_all_gather={str(all_gather).lower()}"])
    block = TransformerBlock(0, cfg.model, TPContext())
    gemms = [m for m in block.modules() if isinstance(m, Fp8Gemm)]
    for gemm in gemms:
        gemm.set_microbatch(True, False)
    cos, sin = block_rotary(cfg)
    block(torch.randn(1, SEQ, cfg.model.dim), cos, sin, None)
    casts = 0 if all_gather else sum(g._weight_cast.untyped_storage().nbytes() for g in gemms)
    buffers = sum(b.numel() * b.element_size() for b in block.buffers())
    assert fp8_state_bytes(cfg.model, 1) == buffers + casts
    linears = [m for m in block.modules() if isinstance(getattr(m, "gemm", None), Fp8Gemm)]
    assert all_gather or casts == sum(m.weight.numel() for m in linears)  # one byte each


def block_rotary(cfg) -> tuple[torch.Tensor, torch.Tensor]:
    rope = Transformer(cfg.model, TPContext(), range(0), embedding=False, head=False).rope
    return rope(torch.arange(SEQ), torch.float32)


def test_a_bf16_reduction_in_flight_is_planned_at_its_bf16_bytes():
    """With reduce_dtype=bf16 a reduction in flight holds its bf16 copy only (the fp32 gradient goes once
    cast: tests/distributed/test_fsdp_grad_reduce.py); the plan counts it so, as the CPU snapshot does."""
    reducing = {}
    for dtype in ("fp32", "bf16"):
        cfg = compose_config(["model=small", f"seq_len={SEQ}", "compute_dtype=fp32", "batch_size=2", "dry_run=true",
                              "world_size=2", f"reduce_dtype={dtype}", "grad_reduce=per_microbatch"])
        reducing[dtype] = plan(cfg, validate(cfg, 2))["memory"]["per_stage"][0]["snapshot"]["reducing_gradients"]
    assert reducing["fp32"] > 0 and reducing["bf16"] * 2 == reducing["fp32"]
