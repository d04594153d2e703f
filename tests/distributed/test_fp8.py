"""fp8 through the trainer's step on 8 gloo ranks (tp2 x dp4, gpipe, two microbatches per step), after
the same layout in bf16 with four microbatches (bitwise with optimize_backward_concat on and off):
identical scales on every rank, ONE amax all-reduce per step, bitwise determinism and bitwise parity
with optimize_backward_concat on and off, and the fp8 all-gather: bitwise the same training in fp32
compute and under activation checkpointing, with a quarter of the fp32 (half of the bf16) weight bytes
per gather; and ZB-H1 and ZB-V on tp2 x pp2 x dp2, whose deferred weight-gradient GEMMs train as 1F1B's."""

import math
from dataclasses import replace

import torch

from model.fp8 import INPUT, WEIGHT, fp8_gemms
from parallel import comm
from tests.distributed.pipeline_cases import SEQ, config, make_trainer, reference_of, train
from tests.distributed.spawn import run_ranks

# Every fp8 GEMM dimension a multiple of 16 under tp=2: head_dim 16, ffn hidden 96, 2 x 8 tokens.
FP8_MODEL = {"n_layers": 4, "dim": 32, "n_heads": 2, "n_kv_heads": 2, "use_fp8": True}
GRAD_NORM_RTOL = 0.05
LAYOUT = dict(model_parallel_size=2, pipeline_schedule="gpipe", batch_size=4, microbatch_size=2)


def fp8_config(model: dict | None = None, **overrides):
    return config(model=FP8_MODEL | (model or {}), **(LAYOUT | overrides))


def _scaling_state(trainer) -> torch.Tensor:
    gemms = fp8_gemms(trainer.chunks)
    return torch.cat([torch.cat([g.scale, g.amax_history.flatten(), g.scale_is_set.float()]) for g in gemms])


def _check_bf16_microbatches(world: int) -> None:
    """numerics_matrix.sh's row b in-process: tp2 x dp4 in bf16, four microbatches of one sequence,
    bitwise the same with optimize_backward_concat off and on."""
    runs = [reference_of(train(config(model=FP8_MODEL | {"use_fp8": False}, **LAYOUT | {
        "compute_dtype": "bf16", "microbatch_size": 1, "optimize_backward_concat": concat, "steps": 2}), world)[1])
        for concat in (False, True)]
    assert runs[0] == runs[1], runs


def _check_fp8(rank: int, world: int) -> None:
    _check_bf16_microbatches(world)
    _, bf = train(config(model=FP8_MODEL | {"use_fp8": False}, **LAYOUT), world)
    trainer, base = train(fp8_config(reshard_after_forward=False), world)
    _, concat = train(fp8_config(reshard_after_forward=False, optimize_backward_concat=True), world)
    _, again = train(fp8_config(reshard_after_forward=False), world)

    # fp8 trains the same model: close to the compute-dtype run, and exactly reproducible. The losses
    # stay near ln(vocab) in 3 steps whatever the GEMMs do; the gradient norms are what tell.
    for a, b in zip(base, bf, strict=True):
        assert math.isclose(a.loss, b.loss, rel_tol=2e-2), (a.loss, b.loss)
        assert math.isclose(a.grad_norm, b.grad_norm, rel_tol=GRAD_NORM_RTOL), (a.grad_norm, b.grad_norm)
    assert reference_of(again) == reference_of(base)
    assert reference_of(concat) == reference_of(base), (reference_of(concat), reference_of(base))

    # Every rank (tp and dp) holds the same scales and histories, and they moved off their start.
    state = _scaling_state(trainer)
    gathered = comm.all_gather_object(state.tolist(), comm.world())
    assert all(other == gathered[0] for other in gathered), "fp8 scaling state differs across ranks"
    scales = torch.stack([g.scale for g in fp8_gemms(trainer.chunks)])
    assert len(scales) == 4 * FP8_MODEL["n_layers"] and (scales != 1.0).all()

    # One batched amax all-reduce per step, whatever the number of fp8 layers.
    for fp8_step, plain_step in zip(base, bf):
        assert fp8_step.comm["all_reduce"]["count"] == plain_step.comm["all_reduce"]["count"] + 1
        assert fp8_step.comm["all_reduce"]["bytes"] == plain_step.comm["all_reduce"]["bytes"] + len(scales) * 3 * 4

    _check_first_step(world)
    _check_fp8_all_gather(world)
    _check_zero_bubble(world)


def _check_first_step(world: int) -> None:
    """Step 1 starts from a "step 0" that recorded the weights' amaxes only, and its tiny output
    gradients are cast with their own amax's scale: no block gradient entry flushes to zero (with
    the initial scales, about 10% of them did)."""
    trainer, _ = train(fp8_config(steps=1), world)
    for gemm in fp8_gemms(trainer.chunks):
        step0, step1 = gemm.amax_history[-2], gemm.amax_history[-1]
        assert step0[WEIGHT] > 0 and step0[INPUT] == 0 and (step1 > 0).all(), gemm.amax_history[-2:]
        # Step 0 saw every piece of the weight: the same amax as step 1's cast of the whole weight.
        assert step0[WEIGHT] == step1[WEIGHT] and gemm.scale_is_set.all() and gemm.activation_scales_set
        # Unmarked again after the step: a forward the runtime does not drive (a probe, generation)
        # casts the updated weights afresh instead of reusing the cast made before the optimizer step.
        assert gemm.is_first_microbatch is None and gemm._weight_cast is None
    state = trainer.optimizer.state()
    zeros = total = 0
    for unit in (u for root in trainer.roots for u in root.units if u.name.startswith("layers.")):
        real = max(0, min(unit.spec.total - unit.rank * unit.spec.shard_size, unit.spec.shard_size))
        first_moment = state[f"{unit.name}.flat_param"]["exp_avg"][:real]  # (1 - beta1) x step 1's gradient
        zeros, total = zeros + int((first_moment == 0).sum()), total + real
    zeros, total = (sum(x) for x in zip(*comm.all_gather_object((zeros, total), comm.world())))
    assert zeros <= 1e-3 * total, f"{zeros} of {total} block gradient entries are zero after step 1"


def _check_fp8_all_gather(world: int) -> None:
    """ZeRO-3 with fp8 weights gathered as fp8 (the e4m3 format, weight gradients in the compute dtype
    this time): the GEMMs see the very same fp8 weights, so fp32 training is bitwise unchanged, also
    when full activation checkpointing recomputes every block (and its fp8 casts) in the backward."""
    variant = {"fp8_format": "e4m3", "fp8_wgrad": False}
    _, plain = train(fp8_config(model=variant), world)
    trainer, gathered = train(fp8_config(model=variant | {"fp8_all_gather": True, "layer_ckpt": "full"}), world)
    assert reference_of(gathered) == reference_of(plain), (reference_of(gathered), reference_of(plain))

    gathers_per_step = 2 * trainer.cfg.num_microbatches  # before each forward and each backward
    block_units = [u for root in trainer.roots for u in root.units if u.name.startswith("layers.")]
    other_units = [u for root in trainer.roots for u in root.units if not u.name.startswith("layers.")]
    block_elements = sum(u.spec.padded for u in block_units)
    other_bytes = sum(u.spec.padded * 4 for u in other_units)
    # Norm weights travel in their own small compute-dtype gather: at most 2 x dim per shard per block.
    norm_bound = len(block_units) * world // 2 * 2 * FP8_MODEL["dim"] * 4
    fp8_bytes = gathered[-1].comm["all_gather"]["bytes"] / gathers_per_step - other_bytes
    assert block_elements <= fp8_bytes <= block_elements + norm_bound, (fp8_bytes, block_elements)
    assert plain[-1].comm["all_gather"]["bytes"] / gathers_per_step - other_bytes == 4 * block_elements
    bf16_block_bytes = 2 * block_elements
    assert fp8_bytes <= bf16_block_bytes / 2 + norm_bound


def _check_zero_bubble(world: int) -> None:
    """tp2 x pp2 x dp2, four microbatches: the W GEMMs read the fp8 operands their B quantized (whose
    amaxes it recorded), so ZB-H1 trains and scales as 1F1B does, in both fp8 weight-gradient modes."""
    for wgrad in (True, False):
        cfg = fp8_config(model={"fp8_wgrad": wgrad}, pipeline_parallel_size=2, batch_size=8)
        plain_trainer, plain = train(cfg, world)
        trainer = make_trainer(replace(cfg, pipeline_schedule="zb_h1"), world)
        runtime, works = trainer.runtime, []
        weight = runtime._weight
        runtime._weight = lambda a: (works.append(len(runtime._weight_work[(a.chunk, a.microbatch)])), weight(a))
        zero_bubble = [trainer.train_step(step) for step in range(1, trainer.cfg.steps + 1)]
        assert trainer.cfg.num_microbatches == 4 and trainer.mesh.dims.dp == 2
        assert min(works) >= len(fp8_gemms(trainer.chunks)) > 0, works  # each W runs every fp8 GEMM's
        assert reference_of(zero_bubble) == reference_of(plain), (wgrad, reference_of(zero_bubble), reference_of(plain))
        assert torch.equal(_scaling_state(trainer), _scaling_state(plain_trainer)), wgrad
        _check_zero_bubble_v(cfg, plain, _named_scaling_states(plain_trainer), world)


def _named_scaling_states(trainer) -> dict[str, torch.Tensor]:
    """Every fp8 GEMM's scale, amax history and flag, by its module's name in the whole model, from all ranks."""
    mine = {name: torch.cat([g.scale, g.amax_history.flatten(), g.scale_is_set.float()])
            for chunk in trainer.chunks for name, g in chunk.named_modules() if g in fp8_gemms([chunk])}
    merged = {}
    for states in comm.all_gather_object(mine, comm.world()):
        merged.update(states)
    return merged


def _check_zero_bubble_v(cfg, plain: list, plain_states: dict, world: int) -> None:
    """ZB-V on the same ranks (two chunks of one layer per rank, in a V): each W runs every fp8 GEMM of
    its chunk; the losses and every GEMM's scaling state (by name) are 1F1B's, bit for bit, and the
    gradient norms within 1e-6."""
    trainer = make_trainer(replace(cfg, pipeline_schedule="zbv", num_layers_per_virtual_pipeline_stage=1), world)
    runtime, works = trainer.runtime, []
    weight = runtime._weight
    runtime._weight = lambda a: (works.append((a.chunk, len(runtime._weight_work[(a.chunk, a.microbatch)]))), weight(a))
    zero_bubble = [trainer.train_step(step) for step in range(1, trainer.cfg.steps + 1)]
    assert all(n >= len(fp8_gemms([trainer.chunks[c]])) > 0 for c, n in works), works
    ours, theirs = reference_of(zero_bubble), reference_of(plain)
    assert ours["loss"] == theirs["loss"], (ours, theirs)
    # The norm's per-rank partial sums group other layers in the V: the same squares, summed in another order.
    assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(ours["grad_norm"], theirs["grad_norm"])), (ours, theirs)
    states = _named_scaling_states(trainer)
    assert states and states.keys() == plain_states.keys()
    assert all(torch.equal(states[k], plain_states[k]) for k in states)


def test_fp8_on_tp2_dp4():
    assert SEQ * LAYOUT["microbatch_size"] % 16 == 0
    run_ranks(8, _check_fp8)
