"""torchrun train.py with pipeline parallelism: the loss falls, a resume is bitwise, and a pipeline
checkpoint reloads without pipeline parallelism (units are keyed by their names in the whole model)
and under the V-shaped zero-bubble schedule, pipeline_schedule=zbv (stages placed in a V), which logs
its simulated bubble; both reloads run with gradient_accumulation_fusion=true.
Both resume the straight run's own step-3 checkpoint; a job that dies and resumes in its own dump_dir
is tests/e2e/test_train.py's."""

import math
import shutil

from tests.e2e.launch import losses, metrics, train, train_ok

FAST = ("model=tiny", "model.n_layers=4", "seq_len=64", "optim.warmup_steps=1", "optim.lr=1e-2", "log_all_steps=true")
# 2 stages x 2 chunks of one layer; 3 microbatches, not a multiple of the 2 stages. Virtual stages
# alone select the interleaved 1F1B (the default pipeline_schedule=1f1b), as in the product's command.
INTERLEAVED = ("pipeline_parallel_size=2", "num_layers_per_virtual_pipeline_stage=1", "batch_size=3")


def test_interleaved_resume_is_bitwise_and_reloads_without_pipeline(tmp_path):
    straight_dir = tmp_path / "straight"
    straight_run = {r["step"]: r for r in train_ok(2, straight_dir, *FAST, "steps=6", "checkpoint.freq=3", *INTERLEAVED)}
    straight = {step: r["loss"] for step, r in straight_run.items()}
    assert straight[6] < straight[1] - 0.3, straight
    step_3 = straight_dir / "checkpoints" / "step_3"
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(step_3, resumed_dir / "checkpoints" / "step_3")
    records = train_ok(2, resumed_dir, *FAST, "steps=6", *INTERLEAVED)
    assert [r["step"] for r in records] == [4, 5, 6]
    resumed = losses(records)
    for step in (4, 5, 6):
        assert resumed[step] == straight[step], (step, resumed[step], straight[step])

    relaid = tmp_path / "relaid"
    shutil.copytree(step_3, relaid / "checkpoints" / "step_3")
    relaid_run = train_ok(0, relaid, *FAST, "steps=6", "batch_size=3", "gradient_accumulation_fusion=true")
    assert [r["step"] for r in relaid_run] == [4, 5, 6]
    for record in relaid_run:
        for key in ("loss", "grad_norm"):
            want = straight_run[record["step"]][key]
            assert math.isclose(record[key], want, rel_tol=1e-5), (record["step"], key, record[key], want)

    zero_bubble = tmp_path / "zero_bubble"
    shutil.copytree(step_3, zero_bubble / "checkpoints" / "step_3")
    proc = train(2, zero_bubble, *FAST, "steps=6", "pipeline_parallel_size=2", "batch_size=3", "pipeline_schedule=zbv",
                 "num_layers_per_virtual_pipeline_stage=1", "gradient_accumulation_fusion=true")
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "gradient_accumulation_fusion=true changes nothing" not in proc.stdout + proc.stderr  # fp32 compute
    assert "pipeline schedule zbv: pp=2 vpp=2 microbatches=3, simulated bubble" in proc.stdout + proc.stderr
    zero_bubble_run = metrics(zero_bubble)
    assert [r["step"] for r in zero_bubble_run] == [4, 5, 6]
    for record in zero_bubble_run:
        for key in ("loss", "grad_norm"):
            want = straight_run[record["step"]][key]
            assert math.isclose(record[key], want, rel_tol=1e-5), ("zbv", record["step"], key, record[key], want)
