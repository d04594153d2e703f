"""The step-time model against the machine: six layouts of model=small on 4 CPU ranks, trained by
train.py and predicted with the CPU profile measured on the spot, rank as measured. It times the
machine, so it runs alone, after the parallel part of the suite (marker `alone`, scripts/test.sh)."""

import pytest

from scripts.bench.plan_time import MIN_CORRELATION, measure_and_predict, ranking

pytestmark = pytest.mark.alone


def test_predicted_step_times_rank_the_layouts_as_measured(tmp_path):
    rows = measure_and_predict(tmp_path)
    correlation, fastest, top2 = ranking(rows)
    assert correlation >= MIN_CORRELATION, rows
    assert fastest in top2, rows
    # Every layout is predicted, none at zero: a ranking of constants would be no model.
    assert all(predicted > 0 for _, predicted in rows.values()) and len({p for _, p in rows.values()}) == len(rows)
