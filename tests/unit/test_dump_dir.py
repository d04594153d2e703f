"""The dump_dir lock: a live holder keeps others out; a dead or silent one does not; only the holder
releases it."""

import json
import os
import subprocess
import sys
import time

from trainer.dump_dir import LOCK_FILE, STALE_AFTER_S, DumpDirLock, _unwritable


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_live_holder_keeps_a_second_job_out(tmp_path):
    first, second = DumpDirLock(tmp_path, "job-a"), DumpDirLock(tmp_path, "job-b")
    assert first.acquire() is None
    try:
        holder = second.acquire()
        assert holder is not None and "job-a" in holder and str(os.getpid()) in holder
    finally:
        first.release()
    assert not (tmp_path / LOCK_FILE).exists()
    assert second.acquire() is None  # free again once released
    second.release()


def test_a_lock_whose_holder_died_or_went_silent_is_taken_over(tmp_path):
    lock = tmp_path / LOCK_FILE
    owner = DumpDirLock(tmp_path, "new").owner
    lock.write_text(json.dumps({**owner, "pid": _dead_pid(), "job": "dead"}))
    taker = DumpDirLock(tmp_path, "new")
    assert taker.acquire() is None
    assert json.loads(lock.read_text())["job"] == "new"
    taker.release()

    lock.write_text(json.dumps({**owner, "host": "another-node", "pid": 1, "job": "silent"}))
    past = time.time() - STALE_AFTER_S - 1
    os.utime(lock, (past, past))
    taker = DumpDirLock(tmp_path, "new")
    assert taker.acquire() is None
    taker.release()


def test_a_restarted_attempt_of_the_same_job_takes_over_its_live_looking_lock(tmp_path):
    """torchrun --max-restarts may put the new attempt's rank 0 on another node within the heartbeat
    window: the earlier attempt's lock is its own job's, and torchrun stopped that attempt first."""
    lock = tmp_path / LOCK_FILE
    earlier = {"host": "another-node", "pid": 1, "job": "job-7", "attempt": 0, "since": time.time()}
    for job, attempt, taken in (("job-7", 1, True), ("job-7", 0, False), ("job-8", 1, False)):
        lock.write_text(json.dumps(earlier))
        taker = DumpDirLock(tmp_path, job, attempt)
        holder = taker.acquire()
        assert (holder is None) == taken, (job, attempt, holder)
        if taken:
            assert json.loads(lock.read_text())["attempt"] == 1
            taker.release()
        else:
            assert "job job-7 (host another-node" in holder


def test_release_leaves_another_jobs_lock_alone(tmp_path):
    lock = DumpDirLock(tmp_path, "mine")
    assert lock.acquire() is None
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 1, "job": "theirs", "since": 0}))
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["job"] == "theirs"


def test_unwritable_dump_dir_is_found_before_any_work(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert "dump_dir=" in _unwritable(not_a_folder / "run", checkpoints=False)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("")  # a file where the checkpoints folder goes
    assert _unwritable(tmp_path / "run", checkpoints=False) is None
    assert "checkpoints/ folder" in _unwritable(tmp_path / "run", checkpoints=True)
