"""metrics.jsonl: the step line's ETA counts the wall time between logged steps, checkpoint saves included;
the history a resume reads back."""

import pytest

from parallel.errors import ConfigError
from trainer.metrics import MetricsLog, StepMetrics, read_history


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
