"""A reference run that several e2e modules compare against, trained once per session."""

from pathlib import Path

import pytest

from tests.e2e.launch import train_ok

# 6 steps on 2 ranks, a checkpoint every 2 steps, never interrupted.
CHECKPOINTED_RUN = ("model=tiny", "seq_len=64", "optim.warmup_steps=1", "optim.lr=1e-2", "log_all_steps=true",
                    "batch_size=2", "steps=6", "checkpoint.freq=2")


@pytest.fixture(scope="session")
def checkpointed_run(tmp_path_factory) -> Path:
    """The dump_dir of CHECKPOINTED_RUN: the losses a killed and restarted run must end with, and the
    checkpoints an asynchronous save must write byte for byte."""
    dump = tmp_path_factory.mktemp("checkpointed_run")
    train_ok(2, dump, *CHECKPOINTED_RUN)
    return dump
