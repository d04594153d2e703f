"""Validation loss end to end: eval_loss on the held-out split is the same number for every layout
(here one process, dp=2 and pp=2), and evaluating leaves training untouched."""

import math

from tests.e2e.launch import losses, train_ok

BASE = ("model=tiny", "seq_len=64", "steps=4", "optim.warmup_steps=1")
TINY = (*BASE, "log_freq=100")
EVAL = ("eval.freq=2", "eval.steps=2")


def _eval_losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in records if "eval_loss" in r}


def test_eval_loss_is_layout_independent_and_leaves_training_alone(tmp_path):
    one = train_ok(0, tmp_path / "one", *TINY, *EVAL, "batch_size=4")
    layouts = {
        "dp2": train_ok(2, tmp_path / "dp2", *TINY, *EVAL, "batch_size=2"),
        "pp2": train_ok(2, tmp_path / "pp2", *TINY, *EVAL, "batch_size=4", "pipeline_parallel_size=2"),
    }
    reference = _eval_losses(one)
    assert sorted(reference) == [2, 4]  # every eval.freq steps; records on those steps, log_freq or not
    assert reference[4] < reference[2]  # it learns what it never saw
    for name, records in layouts.items():
        assert sorted(_eval_losses(records)) == [2, 4], name
        for step, value in _eval_losses(records).items():
            assert math.isclose(value, reference[step], rel_tol=1e-6), (name, step, value, reference[step])
    without_eval = train_ok(0, tmp_path / "no_eval", *BASE, "batch_size=4", "log_all_steps=true")
    assert losses(without_eval)[4] == losses(one)[4]  # evaluation changed nothing in training
