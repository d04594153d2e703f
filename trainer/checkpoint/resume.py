"""Resume: continue the newest complete checkpoint of the dump_dir, and only if that continues the
same run (trainer/checkpoint/fingerprint.py), with a step count that does not end before it."""

from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from parallel import comm
from parallel.errors import ConfigError
from parallel.random import RNGStreams
from trainer.checkpoint.files import (CheckpointError, checkpoint_step, file_is_intact, latest_checkpoint,
                                      refuse_damaged_newer, verify_checkpoint)
from trainer.checkpoint.fingerprint import check_resumable
from trainer.checkpoint.state import load_into
from trainer.config.schema import TrainConfig
from trainer.data.sampler import GlobalBatchSampler
from trainer.observability.metrics import check_history
from trainer.outputs import CHECKPOINTS_DIR, FINGERPRINT_FILE


def refuse_a_changed_run_early(cfg: TrainConfig, config_fingerprint: dict) -> None:
    """Before the data is prepared (hours for a new corpus): the refusals resume() would give on the
    steps and the config keys of the fingerprint, from the newest checkpoint's fingerprint.json alone.
    A fingerprint.json that does not match its manifest (a flipped bit could read as a changed key)
    is left to resume(), which verifies the checkpoint and names the remedy."""
    path = newest_checkpoint(Path(cfg.dump_dir) / CHECKPOINTS_DIR)
    if path is None or not file_is_intact(path, FINGERPRINT_FILE):
        return
    _check_steps(cfg, path)
    check_resumable(path, config_fingerprint, cfg.resume.allow_changed)


def newest_checkpoint(root: Path) -> Path | None:
    """The newest complete checkpoint under `root`, the same on every rank: a node whose listing of the
    shared folder lags (a network filesystem's cache, just after a restart) would load another step,
    and the job would train on a mix of two states."""
    path = latest_checkpoint(root)
    newest = checkpoint_step(path) if path is not None else 0
    steps = comm.all_gather_object(newest, comm.world())
    differing = [rank for rank, step in enumerate(steps) if step != steps[0]]
    if differing:
        rank = differing[0]
        raise CheckpointError(
            f"dump_dir: rank {rank} sees {_newest(steps[rank])} in {root}, rank 0 {_newest(steps[0])}; every rank "
            f"must see the same shared folder (a network filesystem may list late: run again)")
    return path


def _newest(step: int) -> str:
    return f"newest checkpoint step_{step}" if step else "no checkpoint"


def resumed_checkpoint(cfg: TrainConfig) -> Path | None:
    """The checkpoint of its dump_dir the run continues (resume() loads the newest complete one);
    None: it starts at step 0."""
    return latest_checkpoint(Path(cfg.dump_dir) / CHECKPOINTS_DIR)


def _check_steps(cfg: TrainConfig, path: Path) -> None:
    if checkpoint_step(path) > cfg.steps:
        raise ConfigError(
            f"steps={cfg.steps} ends before the newest checkpoint ({path}, step {checkpoint_step(path)}); "
            "resuming would train nothing; raise steps, or use a new dump_dir"
        )


def resume(
    cfg: TrainConfig, state: Callable[[], dict], rng: RNGStreams, sampler: GlobalBatchSampler, fingerprint: dict,
    rank: int, world: int, job: str, log: Callable[[str], None],
) -> int:
    """Load the newest complete checkpoint, if any, into `state()` (views of the live tensors, built only
    when there is a checkpoint); returns the step to continue after.
    Every rank reads the same files and reaches the same verdict, so all refuse together."""
    dump_dir = Path(cfg.dump_dir)
    path = newest_checkpoint(dump_dir / CHECKPOINTS_DIR)
    refuse_damaged_newer(dump_dir / CHECKPOINTS_DIR, checkpoint_step(path) if path is not None else 0)
    step = 0
    if path is not None:
        group = dist.group.WORLD
        try:
            verify_checkpoint(path, group, rank, world, cfg.checkpoint.verify_checksums)
        except CheckpointError as e:
            previous = latest_checkpoint(path.parent, before=checkpoint_step(path))
            if previous is None:
                raise
            raise CheckpointError(f"{e}; to resume from the previous complete checkpoint {previous.name}, move "
                                  f"{path.name} out of {path.parent} (keep it: it may be repairable)")
        _check_steps(cfg, path)
        changes = check_resumable(path, fingerprint, cfg.resume.allow_changed)
        step = load_into(path, state(), rng, sampler, group)
        log(f"resumed from {path} (step {step})" + (
            f"; changed (as resume.allow_changed permits, or changing no step taken): {', '.join(changes)}"
            if changes else ""))
    check_history(dump_dir, step, job)
    return step
