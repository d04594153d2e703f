"""The per-step scalars of metrics.jsonl as TensorBoard event files under {dump_dir}/tb/ (one writer rank).

Scalars: loss, eval_loss, lr, grad_norm, tokens/s, step time, TFLOP/s and MFU (end to end and
computing), exposed communication, peak memory, skipped steps, communication bytes per op, and (with
metrics.unit_norms) each unit's gradient and parameter norm. A resumed job purges the events
of the steps it redoes, as metrics.jsonl moves their records aside, so curves never double back.
"""

from pathlib import Path

from trainer.observability.metrics import StepMetrics
from trainer.outputs import TB_DIR

_SCALARS = ("loss", "eval_loss", "lr", "grad_norm", "tokens_per_s", "step_time_s", "tflops", "tflops_compute",
            "comm_wait_s", "mfu", "mfu_compute", "mem_peak_gib", "skipped_steps")


class TensorBoardLog:
    def __init__(self, dump_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package: only when asked

        self.writer = SummaryWriter(log_dir=str(dump_dir / TB_DIR), purge_step=start_step + 1)

    def log(self, m: StepMetrics) -> None:
        for name in _SCALARS:
            value = getattr(m, name)
            if value is not None:
                self.writer.add_scalar(f"train/{name}" if name != "eval_loss" else "eval/loss", value, m.step)
        for op, entry in m.comm.items():
            self.writer.add_scalar(f"comm_bytes/{op}", entry["bytes"], m.step)
        for kind, norms in (("grad", m.unit_grad_norms), ("param", m.unit_param_norms)):
            for unit, value in (norms or {}).items():
                self.writer.add_scalar(f"unit_{kind}_norm/{unit}", value, m.step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
