"""dry_run's memory model against measurement: model=small on CPU layouts (dp, tp + SP, pp 1F1B and
interleaved, tp + SP x pp, CP ring, HSDP, ZeRO-2 and ZeRO-3, layer_ckpt none / full / selective,
grad_reduce per microbatch, gradient accumulation fusion, fp8: eight launches), each rank's live tensor
bytes by category at their peak (mem_snapshot_stop_step) against the plan of its pipeline stage: the
total within 2%, each category within 5%. Several features share a
launch so the whole comparison is a few small launches."""

import json

import pytest

from parallel.launch_env import LaunchEnv
from planner.config import compose_config
from planner.dry_run import plan, planned_world
from tests.e2e.launch import train
from trainer.config.rules import validate

BASE = ("model=small", "seq_len=128", "steps=2", "mem_snapshot_stop_step=2", "compute_dtype=fp32")
LAUNCHES = {
    # ranks, overrides
    "dp2_zero2_full_ckpt": (2, ("batch_size=2", "reshard_after_forward=false", "model.layer_ckpt=full")),
    "tp2_sp_selective_per_microbatch": (2, ("batch_size=2", "model_parallel_size=2", "model.sequence_parallel=true",
                                            "model.layer_ckpt=selective", "grad_reduce=per_microbatch")),
    "pp2_1f1b_fp8": (2, ("batch_size=4", "pipeline_parallel_size=2", "model.use_fp8=true")),
    # dp2 under two chunks, reducing every microbatch: each chunk's queue holds its own reductions in flight
    "pp2_interleaved_dp2_per_microbatch": (4, ("batch_size=2", "pipeline_parallel_size=2", "grad_reduce=per_microbatch",
                                               "num_layers_per_virtual_pipeline_stage=2")),
    "cp2_ring": (2, ("batch_size=2", "context_parallel_size=2", "context_parallel_comm=ring")),
    "hsdp_2x2": (4, ("batch_size=1", "dp_replicate=2")),
    # fused GEMMs write each unit's accumulator from its first weight gradient, beside its activations
    "dp2_zero3_fused_per_microbatch": (2, ("batch_size=2", "gradient_accumulation_fusion=true", "grad_reduce=per_microbatch")),
    "tp2_sp_pp2": (4, ("batch_size=2", "model_parallel_size=2", "model.sequence_parallel=true", "pipeline_parallel_size=2")),
}
CATEGORIES = ("parameters", "gradients", "reducing_gradients", "optimizer_state", "activations")


def predicted(overrides: tuple[str, ...], world: int) -> list[dict]:
    cfg = compose_config([*overrides, "dry_run=true", f"world_size={world}"])
    report = plan(cfg, validate(cfg, planned_world(cfg, LaunchEnv.from_torchrun())))
    return [{**stage["snapshot"], "ranks": stage["ranks"]} for stage in report["memory"]["per_stage"]]


@pytest.mark.parametrize("name", LAUNCHES)
def test_predicted_peak_memory_matches_measured(tmp_path, name):
    nproc, overrides = LAUNCHES[name]
    proc = train(nproc, tmp_path, *BASE, *overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for stage in predicted((*BASE, *overrides), nproc):
        for rank in range(stage["ranks"][0], stage["ranks"][1] + 1):
            report = json.loads((tmp_path / "memory_snapshots" / f"rank{rank}_live_bytes.json").read_text())
            measured = report["peak_bytes"]
            if rank == stage["ranks"][0]:  # docs/planning.md's table: `pytest -s` prints its rows
                cells = [f"{stage[k] / 2**20:.1f} / {measured[k] / 2**20:.1f}" for k in (*CATEGORIES, "total")]
                print(f"| {name} | {rank} | {' | '.join(cells)} |")
            assert abs(stage["total"] / measured["total"] - 1) <= 0.02, (name, rank, stage, measured)
            for key in CATEGORIES:
                assert abs(stage[key] - measured[key]) <= 0.05 * measured[key], (name, rank, key, stage, measured)
