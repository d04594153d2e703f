"""`python train.py dry_run=true world_size=N`: one plain process plans a 1024-rank run of Llama 3 405B in
under a minute and writes plan.json; a training run refuses world_size."""

import json
import time

from tests.e2e.launch import train

MEGATRON_405B = ("model=llama3_405b", "seq_len=8192", "batch_size=256", "compute_dtype=bf16",
                 "model_parallel_size=8", "pipeline_parallel_size=8", "context_parallel_size=2",
                 "pipeline_first_stage_layers=15", "pipeline_last_stage_layers=15", "model.sequence_parallel=true",
                 "model.layer_ckpt=full")


def test_dry_run_plans_1024_ranks_from_one_process(tmp_path):
    start = time.perf_counter()
    proc = train(0, tmp_path, "dry_run=true", "world_size=1024", *MEGATRON_405B, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert time.perf_counter() - start < 60
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["world_size"] == 1024 and plan["layout"]["dp_shard"] == 8
    worst = max(plan["memory"]["per_stage"], key=lambda s: s["peak_bytes"])
    assert plan["memory"]["peak_bytes"] == worst["peak_bytes"] < 80 * 10**9
    assert f"on pipeline stage {worst['pp_rank']} (ranks {worst['ranks'][0]}..{worst['ranks'][1]})" in proc.stdout
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_run_refuses_world_size(tmp_path):
    proc = train(0, tmp_path, "world_size=2", "steps=1")
    assert proc.returncode == 2
    assert "world_size=2 is read by dry_run=true only" in proc.stderr
