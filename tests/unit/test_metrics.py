"""The step line's ETA counts the wall time between logged steps, checkpoint saves included."""

from trainer.metrics import MetricsLog, StepMetrics


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
