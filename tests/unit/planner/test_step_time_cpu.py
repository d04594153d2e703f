"""The step-time model on an oversubscribed CPU (more ranks than cores), and the rank correlation that
scripts/bench/plan_time.py checks it with."""

import dataclasses

import pytest

from parallel.launch_env import LaunchEnv
from planner.config import compose_config
from planner.cpu_profile import gemm_curve
from planner.devices import DeviceProfile
from planner.dry_run import planned_world
from planner import step_time
from planner.step_time import compute_lower_bound, predict
from scripts.bench.plan_time import spearman
from trainer.config.rules import validate

# Fixed numbers, so the test does not depend on this machine's measurement.
CPU = DeviceProfile("cpu", 4.0, 0.05, 0.05, 0.05, 10.0, 2.0, 2.0, gpus_per_node=4, intra_node_latency_us=100,
                    inter_node_latency_us=100, gemm_efficiency=1.0, gemm_half_size=32, overlaps_communication=False,
                    shared_core_latency_us=400)


def layout(*overrides: str):
    cfg = compose_config(["model=small", "seq_len=128", "compute_dtype=fp32", *overrides, "dry_run=true", "world_size=4"])
    return cfg, validate(cfg, planned_world(cfg, LaunchEnv.from_torchrun()))


def test_spearman_against_hand_computed():
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # rank differences 0, 0, 1, -1: 1 - 6 x 2 / (4 x (16 - 1))
    assert spearman([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(0.8)


@pytest.mark.parametrize("overrides", [("batch_size=2",), ("batch_size=8", "pipeline_parallel_size=4")])
def test_ranks_sharing_cores_take_at_least_all_ranks_work_over_the_cores(overrides):
    cfg, dims = layout(*overrides)
    alone = predict(cfg, dims, CPU, 4).step_s
    # A GPU-named profile with the same numbers is never shared: the step of 4 CPU cores for 4 ranks (a
    # pipeline's a little longer: NCCL's receives are not posted ahead, gloo's are).
    gpu = predict(cfg, dims, dataclasses.replace(CPU, name="gpu", gpus_per_node=1), 4).step_s
    assert gpu == alone if dims.pp == 1 else alone < gpu < 1.01 * alone
    one_core = predict(cfg, dims, dataclasses.replace(CPU, gpus_per_node=1), 4).step_s
    assert one_core > gpu
    if dims.pp == 1:  # four equal ranks' compute, one after another on the one core
        assert one_core >= 4 * compute_lower_bound(cfg, dims, CPU, 4)


def test_the_gemm_curve_fit_recovers_its_peak_and_half_size():
    peak, half = 2e11, 48
    assert gemm_curve({rows: peak * rows / (rows + half) for rows in (16, 64, 256, 512)}) == (pytest.approx(peak), half)
    # Throughput growing faster than rows: no positive peak fits, so the largest measured is the peak.
    assert gemm_curve({16: 1e10, 512: 4e11}) == (4e11, 0)


def test_the_fused_optimizer_is_priced_at_fewer_bytes():
    cfg, dims = layout("batch_size=2")
    fused, _ = layout("batch_size=2", "optim.fused=true")
    assert predict(fused, dims, CPU, 4).parts["optimizer"] < predict(cfg, dims, CPU, 4).parts["optimizer"]


def test_a_blocks_elementwise_ops_are_priced_at_their_bytes_over_the_elementwise_bandwidth():
    """model=small (dim 512, 8 heads and 4 KV heads of 64, hidden 1408, vocab 8192), 128 tokens per
    microbatch, fp32, one rank: eager, a block's forward moves 6 x 512 (residual adds) + 10 x 512 +
    10 x 256 (rotary) + 5 x 1408 (SwiGLU) elements per token and 2 x 7 x 512 in its norms, the head 7 x 512
    plus the loss's 4 x 8192 (fp32), so the busiest rank's compute grows by 3 x 128 x (8 blocks x that +
    the head) x 4 bytes over the bandwidth (the backward twice the forward). compile=true fuses them into
    fewer passes; bf16 norms move their fp32 casts too."""
    cfg, dims = layout("batch_size=1")
    without = compute_lower_bound(cfg, dims, dataclasses.replace(CPU, elementwise_gbps=1e12), 4)
    base = compute_lower_bound(cfg, dims, dataclasses.replace(CPU, elementwise_gbps=1.0), 4)
    block, head = (6 * 512 + 10 * 512 + 10 * 256 + 5 * 1408 + 2 * 7 * 512) * 4, 7 * 512 * 4 + 4 * 8192 * 4
    expected = 3 * 128 * (8 * block + head) / 1e9
    assert base - without == pytest.approx(expected, rel=1e-6)
    compiled, _ = layout("batch_size=1", "compile=true")
    assert compute_lower_bound(compiled, dims, dataclasses.replace(CPU, elementwise_gbps=1.0), 4) < base
    assert step_time._elementwise_bytes(cfg, dims, 2)[0] == (6 * 512 + 10 * 512 + 10 * 256 + 5 * 1408) * 2 + 2 * 18 * 2 * 512
    # Without a measured elementwise bandwidth, a profile prices them at its HBM bandwidth.
    assert CPU.elementwise_bytes_per_s == CPU.hbm_gbps * 1e9


def test_zero_bubbles_w_is_the_weight_gradient_gemms_and_b_the_rest():
    """zb_h1 prices W as the linears' GEMMs of a microbatch (what the weight gradients repeat) and B as the
    rest of the backward (input-gradient GEMMs, attention, elementwise ops): W's share is below half."""
    cfg, dims = layout("batch_size=8", "pipeline_parallel_size=4", "pipeline_schedule=zb_h1")
    c = step_time._costs(cfg, dims, CPU, 4)
    seconds, compute, weight = step_time._unit_times(c, ["block"], step_time.BACKWARD, cfg, False, False, False)
    assert weight == c.weight["block"] and 0 < weight < compute / 2
    assert step_time._unit_times(c, ["block"], step_time.FORWARD, cfg, False, False, False)[2] == 0.0


def test_zero_bubble_v_puts_the_embedding_and_the_head_on_rank_0_and_predicts_less_idle_time():
    """zbv's V: rank 0 runs stage 0 (embedding) and the last stage (head), rank pp - 1 the two middle
    stages. With the same work per rank as zb_h1 (the head still on one rank), its predicted bubble is
    the smaller one."""
    from planner.units import rank_chunks

    v_shape, h1 = (layout("batch_size=8", "pipeline_parallel_size=2", *schedule)
                   for schedule in (("pipeline_schedule=zbv", "num_layers_per_virtual_pipeline_stage=2"),
                                    ("pipeline_schedule=zb_h1",)))
    chunks = [rank_chunks(v_shape[0], r) for r in range(2)]
    assert [(c.embedding, c.head, c.blocks) for c in chunks[0]] == [(True, False, 2), (False, True, 2)]
    assert not any(c.embedding or c.head for c in chunks[1])
    zbv, zb_h1 = (predict(cfg, dims, CPU, 4) for cfg, dims in (v_shape, h1))
    assert zbv.parts["pipeline bubble"] < zb_h1.parts["pipeline bubble"], (zbv.parts, zb_h1.parts)
