"""metrics.wandb=true, offline (WANDB_MODE=offline, as on machines without a W&B server): rank 0 logs the
scalars TensorBoard gets, every logged step once, into one W&B run that a resumed job continues; read
back from the offline run's own files with the wandb package's record messages."""

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.e2e import launch
from tests.e2e.launch import metrics, train_ok
from tests.e2e.wandb_offline import history, records

WANDB = ("model=tiny", "seq_len=64", "batch_size=1", "log_all_steps=true", "eval.freq=2", "eval.steps=1",
         "metrics.unit_norms=true", "metrics.tensorboard=true", "checkpoint.freq=3", "metrics.wandb=true",
         "metrics.wandb_project=edges", "metrics.wandb_run_name=tiny-dp2", "metrics.wandb_tags=[cpu,smoke]")
_W_AND_B_OWN = ("_step", "_timestamp", "_runtime")


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """wandb's environment for the launched jobs: offline, quiet, a short start-up timeout, and its
    per-user folders under tmp_path (the run's own files go to the dump_dir: the trainer's choice)."""
    home = tmp_path / "wandb_home"
    for name, value in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_INIT_TIMEOUT": "60",
                        "WANDB_CONFIG_DIR": home / "config", "WANDB_CACHE_DIR": home / "cache",
                        "WANDB_DATA_DIR": home / "data"}.items():
        monkeypatch.setitem(launch.ENV, name, str(value))
    monkeypatch.delitem(launch.ENV, "WANDB_DIR", raising=False)


def _tensorboard(dump_dir) -> dict[int, dict[str, float]]:
    events = EventAccumulator(str(dump_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    by_step: dict[int, dict[str, float]] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            by_step.setdefault(event.step, {})[tag] = event.value
    return by_step


def test_offline_run_holds_every_step_once_across_a_resume(tmp_path, offline_wandb):
    dump = tmp_path / "run"
    train_ok(2, dump, *WANDB, "steps=3", "optim.decay_steps=5")
    run_id = json.loads((dump / "wandb_run.json").read_text())["id"]
    train_ok(2, dump, *WANDB, "steps=5")  # resumes step 3's checkpoint
    assert json.loads((dump / "wandb_run.json").read_text())["id"] == run_id
    # One offline run folder per job (rank 0's), both of the same W&B run.
    files = sorted((dump / "wandb").glob("offline-run-*/run-*.wandb"))
    assert [f.name for f in files] == [f"run-{run_id}.wandb"] * 2, files
    for file in files:
        [run] = [r.run for r in records(file) if r.WhichOneof("record_type") == "run"]
        assert (run.run_id, run.project, run.display_name, list(run.tags)) == (run_id, "edges", "tiny-dp2",
                                                                                ["cpu", "smoke"])
    rows = [row for file in files for row in history(file)]
    assert [row["_step"] for row in rows] == [1, 2, 3, 4, 5]
    tensorboard, logged = _tensorboard(dump), {r["step"]: r for r in metrics(dump)}
    assert sorted(tensorboard) == sorted(logged) == [1, 2, 3, 4, 5]
    for row in rows:
        step = row["_step"]
        scalars = {k: v for k, v in row.items() if k not in _W_AND_B_OWN}
        assert sorted(scalars) == sorted(tensorboard[step]), step  # the same set as TensorBoard's
        for name, value in scalars.items():
            assert value == pytest.approx(tensorboard[step][name], rel=1e-6), (step, name)
        assert scalars["train/loss"] == logged[step]["loss"]  # full precision, as metrics.jsonl
        assert scalars["unit_grad_norm/head"] == logged[step]["unit_grad_norms"]["head"]
        assert ("eval/loss" in scalars) == ("eval_loss" in logged[step])
    # eval.freq=2, and after each job's last step
    assert [row["_step"] for row in rows if "eval/loss" in row] == [2, 3, 4, 5]
