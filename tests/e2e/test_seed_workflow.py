"""The seed workflow's command line, in its hydra form and CPU-sized (model=tiny with 8 layers: 2 virtual
stages of 2 layers per pipeline rank; short sequences), trains: 8 ranks, tp2 x pp2 with interleaved
virtual stages, sequence parallel, fp8 with the weight gradient in fp8, deterministic, every step
logged, a profiled step's traces and a memory snapshot."""

import json

from tests.e2e.launch import train

SEED_WORKFLOW = (
    "model=tiny", "model.n_layers=8", "seq_len=32", "steps=3",
    "model_parallel_size=2", "pipeline_parallel_size=2", "num_layers_per_virtual_pipeline_stage=2",
    "batch_size=4", "reshard_after_forward=false",
    "optimize_backward_concat=true", "enable_deterministic_training=true",
    "model.sequence_parallel=true", "model.use_fp8=true", "model.fp8_wgrad=true",
    "log_all_steps=true", "log_freq=1",
    "profile_freq=2", "dump_profile_traces=true", "mem_snapshot_stop_step=2",
)


def test_seed_workflow_trains_three_steps_on_eight_cpu_ranks(tmp_path):
    dump = tmp_path / "run"
    proc = train(8, dump, *SEED_WORKFLOW, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "pipeline schedule interleaved_1f1b: pp=2 vpp=2 microbatches=4" in proc.stderr
    assert "changes nothing" not in proc.stderr  # every key of the command line takes effect on this layout
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert steps == [1, 2, 3], records
    assert all(r["loss"] > 0 for r in records if "loss" in r)
    traces = dump / "profile_traces" / "step_2"
    assert sorted(p.name for p in traces.iterdir()) == [f"rank{r}.json" for r in range(8)]
    for rank in range(8):
        events = json.loads((traces / f"rank{rank}.json").read_text())["traceEvents"]
        assert any(e.get("ph") == "X" for e in events), rank
        snapshot = json.loads((dump / "memory_snapshots" / f"rank{rank}_live_bytes.json").read_text())
        assert snapshot["last_step"] == 2 and snapshot["peak_bytes"]["total"] > 0, snapshot
