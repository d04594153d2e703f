"""The step-time model's pricing on a GPU profile: the attention kernel CP actually runs, and the
collectives a recomputed forward runs again."""

import dataclasses

import pytest

from parallel.launch_env import LaunchEnv
from planner.config import compose_config
from planner.devices import DeviceProfile
from planner.dry_run import planned_world
from planner.step_time import compute_lower_bound, predict
from trainer.config.rules import validate

# Round numbers: fp32 ten times slower than bf16, GEMMs at the peak whatever their size.
GPU = DeviceProfile("gpu", 80.0, bf16_tflops=100, fp32_tflops=10, fp8_tflops=200, hbm_gbps=1000, intra_node_gbps=100,
                    inter_node_gbps=10, gpus_per_node=8, intra_node_latency_us=10, inter_node_latency_us=20,
                    gemm_efficiency=1.0, gemm_half_size=0, overlaps_communication=True)


def layout(world: int, *overrides: str):
    cfg = compose_config(["model=small", "seq_len=512", "compute_dtype=bf16", *overrides, "dry_run=true",
                          f"world_size={world}"])
    return cfg, validate(cfg, planned_world(cfg, LaunchEnv.from_torchrun()))


@pytest.mark.parametrize("fp8", [False, True])
def test_cp_attention_is_priced_at_the_kernel_it_runs(fp8):
    """model=small (8 heads of 64, 8 layers), seq 512 over cp=2, batch 2: each rank's causal attention is
    256 rows x 2 x 8 x 64 x 512 FLOPs per block forward, three times over with the backward. The fused
    kernel (sdpa) runs it in bf16, efficient_attn=math in fp32 (the plain formula); fp8 is the linears'
    only, so it changes neither."""
    use_fp8 = (f"model.use_fp8={str(fp8).lower()}",)
    fused, dims = layout(2, "context_parallel_size=2", "batch_size=2", *use_fp8)
    plain, _ = layout(2, "context_parallel_size=2", "batch_size=2", "model.efficient_attn=math", *use_fp8)
    attention = 256 * 2 * 8 * 64 * 512 * 3 * 8 * 2  # x blocks x microbatches
    expected = attention * (1 / 10e12 - 1 / 100e12)
    assert compute_lower_bound(plain, dims, GPU, 2) - compute_lower_bound(fused, dims, GPU, 2) == pytest.approx(
        expected, rel=1e-6)
    without_cp, one = layout(1, "batch_size=2", "model.efficient_attn=math", *use_fp8)
    assert compute_lower_bound(without_cp, one, GPU, 2) == compute_lower_bound(
        dataclasses.replace(without_cp, model=dataclasses.replace(without_cp.model, efficient_attn="sdpa")), one, GPU, 2)


@pytest.mark.parametrize("overrides, passes", [
    # tp=2 with SP: four collectives a block forward; full recompute runs them again, selective not
    (("model_parallel_size=2", "model.sequence_parallel=true", "model.layer_ckpt=full"), 3),
    (("model_parallel_size=2", "model.sequence_parallel=true", "model.layer_ckpt=selective"), 2),
    # cp=2 all-gather: the attention core's own exchange, which a selective recompute re-runs too
    (("context_parallel_size=2", "model.layer_ckpt=selective"), 3),
    (("context_parallel_size=2", "model.layer_ckpt=full"), 3),
])
def test_a_recomputed_forward_runs_its_exchanges_again(overrides, passes):
    """The step's TP/CP communication is the forward's exchanges, the backward's mirror, and the recomputed
    forward's: `passes` forward passes' worth against two without checkpointing."""
    recomputed, dims = layout(2, "batch_size=2", *overrides)
    plain, _ = layout(2, "batch_size=2", *overrides[:-1])
    ratio = (predict(recomputed, dims, GPU, 2).parts["TP/CP communication"]
             / predict(plain, dims, GPU, 2).parts["TP/CP communication"])
    assert ratio == pytest.approx(passes / 2, rel=1e-9)
