"""metrics.tensorboard=true: TensorBoard's own event reader finds every logged step's scalars (eval
loss on eval steps), and a resumed job's redone steps replace the old events instead of doubling."""

import math

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.e2e.launch import died_before_saving, metrics, train_ok

TINY = ("model=tiny", "seq_len=64", "batch_size=2", "log_all_steps=true", "metrics.tensorboard=true",
        "eval.freq=2", "eval.steps=1", "metrics.unit_norms=true")


def _scalars(dump_dir, tag: str) -> dict[int, float]:
    return {e.step: e.value for e in _events(dump_dir, tag)}


def _events(dump_dir, tag: str) -> list:
    events = EventAccumulator(str(dump_dir / "tb"))
    events.Reload()
    return events.Scalars(tag)


def test_tensorboard_events_hold_the_logged_steps_once(tmp_path):
    dump = tmp_path / "run"
    train_ok(0, dump, *TINY, "steps=4", "optim.decay_steps=6", "checkpoint.freq=3")
    died_before_saving(dump, 4)
    train_ok(0, dump, *TINY, "steps=6", "checkpoint.freq=3")  # resumes from step 3: redoes step 4
    records = {r["step"]: r for r in metrics(dump)}
    loss = _scalars(dump, "train/loss")
    assert sorted(loss) == sorted(records) == [1, 2, 3, 4, 5, 6]
    for step, value in loss.items():
        assert math.isclose(value, records[step]["loss"], rel_tol=1e-6), (step, value)
    for event in _events(dump, "train/loss"):  # when the step ended, not when the scalar was written after eval
        assert event.wall_time == records[event.step]["wall_time"], (event, records[event.step]["wall_time"])
    eval_loss = _scalars(dump, "eval/loss")
    assert sorted(eval_loss) == [2, 4, 6]
    assert math.isclose(eval_loss[4], records[4]["eval_loss"], rel_tol=1e-6)
    for tag in ("train/lr", "train/tokens_per_s", "train/tflops", "train/mem_peak_gib", "train/skipped_steps"):
        assert sorted(_scalars(dump, tag)) == [1, 2, 3, 4, 5, 6], tag
    head_grad = _scalars(dump, "unit_grad_norm/head")
    assert math.isclose(head_grad[5], records[5]["unit_grad_norms"]["head"], rel_tol=1e-6)
    assert sorted(_scalars(dump, "unit_param_norm/layers.1")) == [1, 2, 3, 4, 5, 6]
