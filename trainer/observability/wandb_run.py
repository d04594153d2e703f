"""The per-step scalars of metrics.jsonl (scalars.py names them, as TensorBoard shows them) logged to a
Weights & Biases run from rank 0 (metrics.wandb=true; the optional `wandb` package, the `wandb` extra).

A resumed job continues the same W&B run: its id is kept in {dump_dir}/wandb_run.json. W&B's own files go
under {dump_dir}/wandb/. wandb reads its environment itself (WANDB_MODE=offline logs without a server,
WANDB_API_KEY, ...); the trainer reads none of it.
"""

import dataclasses
import importlib.util
import json
import uuid
from pathlib import Path

from parallel.errors import ConfigError
from trainer.config.schema import TrainConfig
from trainer.observability.metrics import StepMetrics
from trainer.observability.scalars import step_scalars
from trainer.outputs import WANDB_RUN_FILE

INSTALL = "pip install -e '.[wandb]'"


def check_wandb_installed(cfg: TrainConfig) -> None:
    """At start, on every rank: metrics.wandb=true without the package is one line, not a failure at step 1."""
    if cfg.metrics.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(f"metrics.wandb=true needs the wandb package, which is not installed: {INSTALL} "
                          "(or metrics.wandb=false)")


def wandb_run_id(dump_dir: Path, start_step: int) -> str:
    """The W&B run of this job: the dump_dir's (kept in WANDB_RUN_FILE) when the job resumes a checkpoint,
    a new one when it starts from step 0 (a fresh run, whatever an earlier run in the folder logged)."""
    path = dump_dir / WANDB_RUN_FILE
    if start_step > 0:
        try:
            kept = json.loads(path.read_text())["id"]
            if isinstance(kept, str) and kept:
                return kept
        except (OSError, ValueError, KeyError, TypeError):
            pass  # W&B turned on for a resumed run, or the file is unreadable: a new W&B run
    run_id = uuid.uuid4().hex[:12]
    path.write_text(json.dumps({"id": run_id}) + "\n")
    return run_id


class WandbLog:
    def __init__(self, cfg: TrainConfig, dump_dir: Path, start_step: int) -> None:
        import wandb

        m = cfg.metrics
        run_id = wandb_run_id(dump_dir, start_step)
        try:
            # console="off": the job's output stays the launcher's; W&B keeps the scalars and the config.
            self.run = wandb.init(project=m.wandb_project, entity=m.wandb_entity, name=m.wandb_run_name,
                                  tags=list(m.wandb_tags) or None, id=run_id, resume="allow", dir=str(dump_dir),
                                  config=dataclasses.asdict(cfg), settings=wandb.Settings(console="off"))
        except wandb.Error as e:
            raise ConfigError(f"metrics.wandb=true: W&B did not start run {run_id}: {e} (WANDB_MODE=offline logs "
                              "without a server)") from e

    def log(self, m: StepMetrics) -> None:
        self.run.log(step_scalars(m), step=m.step)

    def close(self) -> None:
        self.run.finish()
