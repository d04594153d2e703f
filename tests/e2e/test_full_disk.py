"""A checkpoint that does not fit on its disk (a real small filesystem, not an injected error): the run
stops with one line naming the cause, the half-written save is removed (it would keep the disk full),
and once space is freed the run goes on: from the last checkpoint that fitted, or, when none did, by
the advice the next run prints, as written."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.e2e.launch import assert_one_error, error_lines, metrics, train

RUN = ("model=tiny", "seq_len=64", "batch_size=2", "log_all_steps=true", "optim.warmup_steps=1", "steps=4",
       "checkpoint.freq=2", "checkpoint.keep=1")
DISK = "8m"  # the tiny model's checkpoint (weights and Adam moments) is about 2 MB
LEFT_FREE = 256 * 1024  # room for the run's small files, not for a checkpoint
CHECKPOINT_BYTES = 2 * 1024 * 1024  # at least one checkpoint of the tiny model, less than two


@pytest.fixture
def small_disk(tmp_path):
    """A tmpfs of DISK bytes, unmounted at the end."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK}", "tmpfs", str(disk)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def fill(disk: Path, leave: int) -> Path:
    """A file that takes all but `leave` bytes of the disk."""
    filler = disk / "filler"
    with filler.open("wb") as f:
        f.write(b"\0" * (shutil.disk_usage(disk).free - leave))
    return filler


def test_a_checkpoint_that_does_not_fit_is_one_line_and_the_run_finishes_once_space_is_freed(small_disk):
    dump = small_disk / "dump"
    filler = fill(small_disk, LEFT_FREE)
    proc = train(2, dump, *RUN, timeout=180)
    assert_one_error(proc, f"checkpoint save into {dump}/checkpoints/.tmp_step_2 failed", "No space left on device")
    assert "exitcode: 2" in proc.stderr, proc.stderr[-3000:]
    assert sorted(p.name for p in (dump / "checkpoints").iterdir()) == []  # the failed save removed its folder

    filler.unlink()
    # No checkpoint to continue: the same command refuses the metrics of the failed run, and says what to do.
    proc = train(2, dump, *RUN, timeout=180)
    assert_one_error(proc, "no checkpoint to resume from", "move metrics.jsonl away to start over")
    (dump / "metrics.jsonl").rename(small_disk / "failed_metrics.jsonl")
    proc = train(2, dump, *RUN, timeout=180)
    assert proc.returncode == 0 and not error_lines(proc.stderr), proc.stderr[-3000:]
    assert [r["step"] for r in metrics(dump)] == [1, 2, 3, 4]
    assert sorted(p.name for p in (dump / "checkpoints").iterdir()) == ["step_4"]


def test_a_later_save_that_does_not_fit_resumes_from_the_checkpoint_that_did(small_disk):
    dump = small_disk / "dump"
    filler = fill(small_disk, LEFT_FREE + CHECKPOINT_BYTES + CHECKPOINT_BYTES // 2)
    proc = train(2, dump, *RUN, timeout=180)
    assert_one_error(proc, f"checkpoint save into {dump}/checkpoints/.tmp_step_4 failed", "No space left on device")
    assert sorted(p.name for p in (dump / "checkpoints").iterdir()) == ["step_2"]

    filler.unlink()
    proc = train(2, dump, *RUN, timeout=180)  # the same command, once space is freed
    assert proc.returncode == 0 and not error_lines(proc.stderr), proc.stderr[-3000:]
    assert f"resumed from {dump}/checkpoints/step_2 (step 2)" in proc.stdout + proc.stderr
    assert [r["step"] for r in metrics(dump)] == [1, 2, 3, 4]
    assert sorted(p.name for p in (dump / "checkpoints").iterdir()) == ["step_4"]
