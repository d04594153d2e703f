"""The per-step scalars of metrics.jsonl (scalars.py names them) as TensorBoard event files under
{dump_dir}/tb/ (one writer rank). A resumed job purges the events of the steps it redoes, as metrics.jsonl
moves their records aside, so curves never double back.
"""

from pathlib import Path

from trainer.observability.metrics import StepMetrics
from trainer.observability.scalars import step_scalars
from trainer.outputs import TB_DIR


class TensorBoardLog:
    def __init__(self, dump_dir: Path, start_step: int):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package: only when asked

        self.writer = SummaryWriter(log_dir=str(dump_dir / TB_DIR), purge_step=start_step + 1)

    def log(self, m: StepMetrics) -> None:
        for name, value in step_scalars(m).items():  # stamped when the step ended, as metrics.jsonl (not after eval)
            self.writer.add_scalar(name, value, m.step, walltime=m.wall_time)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
