"""metrics.jsonl: the step line's ETA counts the wall time between logged steps, checkpoint saves included;
the history a resume reads back and repairs."""

import json

import pytest

from parallel.errors import ConfigError
from trainer.observability.metrics import MetricsLog, StepMetrics, read_history


def _metrics(step: int, wall_time: float) -> StepMetrics:
    return StepMetrics(step=step, loss=1.0, grad_norm=1.0, lr=1e-3, tokens_per_s=1.0, step_time_s=0.5, tflops=0.0,
                       tflops_compute=0.0, comm_wait_s=0.0, mfu=None, mfu_compute=None, mem_peak_gib=0.0, comm={},
                       wall_time=wall_time)


def test_eta_includes_checkpoint_saves(tmp_path):
    log = MetricsLog(tmp_path, is_writer=True, total_steps=100, start_step=0)
    first = _metrics(1, 1000.0)
    log.log(first)
    assert log.human_line(first).endswith("ETA 0:00:49")  # a lone record: 99 steps x its 0.5 s step time
    wall = 1000.0
    for step in range(2, 11):
        wall += 1.0 + (20.0 if step == 6 else 0.0)  # step 6 ends after a 20 s checkpoint save
        log.log(_metrics(step, wall))
    # 29 s over 9 steps, not 0.5 s per step: 90 steps left take 290 s.
    assert log.human_line(_metrics(10, wall)).endswith("ETA 0:04:50")


def test_a_history_line_without_an_integer_step_is_damage_named_by_its_line(tmp_path):
    """A resume sorts records by step before it writes anything: a line it cannot sort is one error line
    naming it, not a KeyError after the run's files were rewritten. The last line is a partial write
    (moved aside by the resume), whatever it holds."""
    path = tmp_path / "metrics.jsonl"
    for bad in ('{"foo": 1}', '{"step": "x"}', '{"step": true}', "[" * 100_000 + "]" * 100_000):
        path.write_text(f'{{"step": 1}}\n{bad}\n{{"step": 2}}\n')
        with pytest.raises(ConfigError, match=r"line 2 is not a step record \(a JSON object with an integer \"step\"\)"):
            read_history(path)
        path.write_text(f'{{"step": 1}}\n{bad}\n')
        assert read_history(path) == (['{"step": 1}'], bad)


def test_a_kill_during_the_resume_repair_does_not_supersede_records_twice(tmp_path, monkeypatch):
    """The moved records are appended to the superseded file before metrics.jsonl is replaced: a kill
    in between makes the next resume move the same records again, which are then not appended twice."""
    from trainer.observability import metrics

    log = MetricsLog(tmp_path, is_writer=True, total_steps=6, start_step=0)
    for step in range(1, 7):
        log.log(_metrics(step, 1000.0 + step))
    replace = metrics.os.replace

    def killed(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(metrics.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        MetricsLog(tmp_path, is_writer=True, total_steps=6, start_step=4)
    monkeypatch.setattr(metrics.os, "replace", replace)
    MetricsLog(tmp_path, is_writer=True, total_steps=6, start_step=4)
    steps = [[json.loads(line)["step"] for line in (tmp_path / name).read_text().splitlines()]
             for name in (metrics.METRICS_FILE, metrics.SUPERSEDED_FILE)]
    assert steps == [[1, 2, 3, 4], [5, 6]]
