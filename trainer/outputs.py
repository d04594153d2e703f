"""Every file and folder a job writes directly in its dump_dir, by name, and the probe that says whether a
folder can be written at all (docs/outputs.md describes each). Imports no torch: launchers read these
names before a job starts.
"""

import os
from pathlib import Path

from trainer.config.schema import TrainConfig

CONFIG_FILE = "train_config.json"  # the resolved config, also copied into each checkpoint
LAYOUT_FILE = "layout.json"  # the latest job's parallel sizes and the keys inert on them
FINGERPRINT_FILE = "fingerprint.json"  # what the run is, for a resume to compare (also in each checkpoint)
TOKENIZER_FILE = "tokenizer.model"  # a sentencepiece or tiktoken model (in checkpoints, as in Llama folders)
METRICS_FILE = "metrics.jsonl"
SUPERSEDED_FILE = "metrics.superseded.jsonl"  # records of steps a resumed job redid
REWRITE_FILE = f".{METRICS_FILE}.tmp"  # a resume rewrites metrics.jsonl through it
JOB_FILE = "job.json"  # which job writes metrics.jsonl
STOPPED_FILE = "stopped.json"  # the step a job stopped after on its stop_signal (a batch script requeues on it)
WANDB_RUN_FILE = "wandb_run.json"  # the Weights & Biases run id a resumed job continues (metrics.wandb)
PLAN_FILE = "plan.json"  # dry_run=true's plan: parameters, per-rank memory, FLOPs, the schedule's bubble
LOCK_FILE = ".lock"
TAKEOVER_FILE = ".lock.takeover"

# The files a job writes directly in its dump_dir: a folder by one of these names is refused up front.
JOB_FILES = (LOCK_FILE, TAKEOVER_FILE, METRICS_FILE, SUPERSEDED_FILE, REWRITE_FILE, JOB_FILE, STOPPED_FILE,
             FINGERPRINT_FILE, CONFIG_FILE, LAYOUT_FILE, WANDB_RUN_FILE, PLAN_FILE)

CHECKPOINTS_DIR = "checkpoints"
TB_DIR = "tb"
TRACES_DIR = "profile_traces"
SNAPSHOTS_DIR = "memory_snapshots"
WANDB_DIR = "wandb"  # what the wandb package writes (an offline run's files, its logs)


def output_folders(cfg: TrainConfig) -> dict[str, str]:
    """The folders the job will make in its dump_dir, each with the setting that asks for it."""
    # A stop signal's save writes a checkpoint with checkpoint.freq=0 too.
    saves = "checkpoint.freq > 0" if cfg.checkpoint.freq > 0 else f"stop_signal={cfg.stop_signal}"
    wanted = {CHECKPOINTS_DIR: (cfg.checkpoint.freq > 0 or cfg.stop_signal is not None, saves),
              TB_DIR: (cfg.metrics.tensorboard, "metrics.tensorboard=true"),
              TRACES_DIR: (cfg.dump_profile_traces, "dump_profile_traces=true"),
              SNAPSHOTS_DIR: (cfg.mem_snapshot_stop_step is not None, "mem_snapshot_stop_step"),
              WANDB_DIR: (cfg.metrics.wandb, "metrics.wandb=true")}
    return {name: setting for name, (used, setting) in wanted.items() if used}


def write_problem(folder: Path) -> str | None:
    """Why files cannot be written into `folder` (created if missing), or None: a probe file is."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_probe_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        return f"is not a writable folder: {e.strerror or e}"
    return None
