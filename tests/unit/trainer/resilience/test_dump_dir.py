"""The dump_dir lock: a live holder keeps others out; a dead (in this pid namespace) or silent one does not; only the holder
releases it."""

import json
import os
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from parallel.errors import ConfigError
from trainer.config.schema import from_dict
from trainer.outputs import JOB_FILES, LOCK_FILE, TAKEOVER_FILE, output_folders
from trainer.resilience import dump_dir_lock as dump_dir
from trainer.resilience.dump_dir_lock import STALE_AFTER_S, DumpDirLock, _unwritable


@pytest.fixture(autouse=True)
def short_stale_watch(monkeypatch):
    monkeypatch.setattr(dump_dir, "STALE_CONFIRM_S", 0.3)


@contextmanager
def beating(lock):
    """A holder on another node (or in another pid namespace) that is alive: its heartbeat touches the lock."""
    stop = threading.Event()

    def heartbeat():
        while not stop.wait(0.05):
            os.utime(lock)

    thread = threading.Thread(target=heartbeat)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


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

    # The same host name in another pid namespace (a container on the host network): its pid means
    # nothing here, so only its heartbeat tells, and while it beats the job is live.
    lock.write_text(json.dumps({**owner, "pids": "another-boot pid:[1]", "pid": _dead_pid(), "job": "contained"}))
    with beating(lock):
        holder = DumpDirLock(tmp_path, "new").acquire()
    assert holder is not None and "job contained" in holder

    lock.write_text(json.dumps({**owner, "host": "another-node", "pid": 1, "job": "silent"}))
    past = time.time() - STALE_AFTER_S - 1
    os.utime(lock, (past, past))
    taker = DumpDirLock(tmp_path, "new")
    assert taker.acquire() is None
    taker.release()


def test_a_holder_whose_lock_was_taken_over_or_removed_stops_writing(tmp_path, monkeypatch):
    """A job suspended past the stale age finds, once resumed, that another job owns the folder."""
    monkeypatch.setattr(dump_dir, "HEARTBEAT_S", 0.05)
    for change, why in (("take over", "taken over by job newcomer (host elsewhere, pid 7)"), ("remove", "removed")):
        lock = DumpDirLock(tmp_path, "sleeper")
        assert lock.acquire() is None
        lock.check_owned()
        path = tmp_path / LOCK_FILE
        if change == "remove":
            path.unlink()
        else:
            path.write_text(json.dumps({"host": "elsewhere", "pid": 7, "job": "newcomer", "since": time.time()}))
        deadline = time.monotonic() + 10
        while lock.lost is None and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(ConfigError, match=f"its lock was {re.escape(why)} while this job ran; stopping"):
            lock.check_owned()
        lock.release()
        assert (change == "remove") != path.exists()  # the newcomer's lock is left alone
        path.unlink(missing_ok=True)


def _stale_lock(folder) -> None:
    lock = folder / LOCK_FILE
    lock.write_text(json.dumps({"host": "another-node", "pid": 1, "job": "crashed", "since": 0}))
    past = time.time() - STALE_AFTER_S - 1
    os.utime(lock, (past, past))


def test_two_newcomers_never_both_take_over_one_stale_lock(tmp_path, monkeypatch):
    """Newcomer A takes the stale lock over between newcomer B's verdict (stale) and B's removal of it:
    B must not remove A's fresh lock, so exactly one of them owns the folder."""
    monkeypatch.setattr(dump_dir, "TAKEOVER_RETRY_S", 0.0)
    _stale_lock(tmp_path)
    a, b = DumpDirLock(tmp_path, "job-a"), DumpDirLock(tmp_path, "job-b")
    b_verdict = b._holder
    results = {}

    def b_judges_while_a_takes_over(guard):
        verdict = b_verdict(guard)
        results["a"] = a.acquire()
        return verdict

    monkeypatch.setattr(b, "_holder", b_judges_while_a_takes_over)
    results["b"] = b.acquire()
    try:
        owners = [name for name in "ab" if results[name] is None]
        assert len(owners) == 1, results
        assert json.loads((tmp_path / LOCK_FILE).read_text())["job"] == f"job-{owners[0]}"
        assert not (tmp_path / TAKEOVER_FILE).exists()
        later = DumpDirLock(tmp_path, "job-c").acquire()
        assert later is not None and f"job job-{owners[0]}" in later
    finally:
        a.release()
        b.release()


def test_a_live_lock_that_looks_stale_by_this_hosts_clock_is_not_taken_over(tmp_path):
    """The holder's node (or the file server) runs 60 s behind: its heartbeats stamp times that look
    stale here, but they keep coming."""
    _stale_lock(tmp_path)
    lock, stop = tmp_path / LOCK_FILE, threading.Event()

    def skewed_heartbeat():
        while not stop.wait(0.05):
            behind = time.time() - 60
            os.utime(lock, (behind, behind))

    beating = threading.Thread(target=skewed_heartbeat)
    beating.start()
    try:
        holder = DumpDirLock(tmp_path, "new").acquire()
    finally:
        stop.set()
        beating.join()
    assert holder is not None and "job crashed (host another-node" in holder
    assert DumpDirLock(tmp_path, "new").acquire() is None  # once the beats stop, it is stale
    (tmp_path / LOCK_FILE).unlink()


def test_a_takeover_guard_left_by_a_dead_newcomer_expires(tmp_path):
    _stale_lock(tmp_path)
    guard = tmp_path / TAKEOVER_FILE
    guard.write_text("")
    past = time.time() - STALE_AFTER_S - 1
    os.utime(guard, (past, past))
    taker = DumpDirLock(tmp_path, "new")
    assert taker.acquire() is None
    assert json.loads((tmp_path / LOCK_FILE).read_text())["job"] == "new"
    assert not guard.exists()
    taker.release()


def test_a_restarted_attempt_of_the_same_job_takes_over_its_live_looking_lock(tmp_path):
    """torchrun --max-restarts may put the new attempt's rank 0 on another node within the heartbeat
    window: the earlier attempt's lock is its own job's, and torchrun stopped that attempt first."""
    lock = tmp_path / LOCK_FILE
    earlier = {"host": "another-node", "pid": 1, "job": "job-7", "attempt": 0, "since": time.time()}
    for job, attempt, taken in (("job-7", 1, True), ("job-7", 0, False), ("job-8", 1, False)):
        lock.write_text(json.dumps(earlier))
        taker = DumpDirLock(tmp_path, job, attempt)
        with beating(lock):
            holder = taker.acquire()
        assert (holder is None) == taken, (job, attempt, holder)
        if taken:
            assert json.loads(lock.read_text())["attempt"] == 1
            taker.release()
        else:
            assert "job job-7 (host another-node" in holder


def test_release_leaves_another_jobs_lock_alone(tmp_path):
    """Also one whose holder has this process's pid: a job on another node, or in another container."""
    for pid in (1, os.getpid()):
        lock = DumpDirLock(tmp_path, "mine")
        assert lock.acquire() is None
        (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": pid, "job": "theirs", "since": 0}))
        lock.release()
        assert json.loads((tmp_path / LOCK_FILE).read_text())["job"] == "theirs"
        (tmp_path / LOCK_FILE).unlink()


def test_a_dead_holder_stamped_by_a_clock_ahead_of_ours_is_taken_over(tmp_path, monkeypatch):
    """The dead holder's node (or the file server) runs 10 minutes ahead: its last stamp looks fresh here
    for that long. Watching the lock, not comparing clocks, finds it silent; a live one beats meanwhile."""
    monkeypatch.setattr(dump_dir, "STALE_AFTER_S", 1.0)
    lock = tmp_path / LOCK_FILE
    ahead = time.time() + 600
    for alive in (True, False):
        lock.write_text(json.dumps({"host": "another-node", "pid": 1, "job": "ahead", "since": 0}))
        os.utime(lock, (ahead, ahead))
        taker = DumpDirLock(tmp_path, "new")
        start = time.monotonic()
        if alive:
            with beating(lock):
                holder = taker.acquire()
            assert holder is not None and "job ahead (host another-node" in holder
        else:
            assert taker.acquire() is None and time.monotonic() - start >= 1.0
            assert json.loads(lock.read_text())["job"] == "new"
            taker.release()


def test_unwritable_dump_dir_is_found_before_any_work(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert "dump_dir=" in _unwritable(not_a_folder / "run", {})
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "checkpoints").write_text("")  # a file where the checkpoints folder goes
    assert _unwritable(tmp_path / "run", {}) is None
    assert "checkpoints/ folder" in _unwritable(tmp_path / "run", {"checkpoints": "checkpoint.freq > 0"})


@pytest.mark.parametrize("overrides, folder, setting", [
    ({"checkpoint": {"freq": 2}}, "checkpoints", "checkpoint.freq > 0"),
    # The stop's save writes one with checkpoint.freq=0: found there only when the signal came, after training.
    ({"stop_signal": "USR1"}, "checkpoints", "stop_signal=USR1"),
    ({"metrics": {"tensorboard": True}}, "tb", "metrics.tensorboard=true"),
    ({"profile_freq": 1, "dump_profile_traces": True}, "profile_traces", "dump_profile_traces=true"),
    ({"mem_snapshot_stop_step": 1}, "memory_snapshots", "mem_snapshot_stop_step"),
    ({"metrics": {"wandb": True}}, "wandb", "metrics.wandb=true"),
])
def test_a_file_where_the_job_makes_a_folder_is_refused_naming_its_setting(tmp_path, overrides, folder, setting):
    assert output_folders(from_dict({})) == {}
    folders = output_folders(from_dict(overrides))
    assert folders == {folder: setting}
    (tmp_path / folder).write_text("")
    assert _unwritable(tmp_path, folders).startswith(f"dump_dir (its {folder}/ folder, {setting})={tmp_path / folder} "
                                                     "is not a writable folder")


@pytest.mark.parametrize("name", JOB_FILES)
def test_a_folder_where_the_job_writes_a_file_is_refused_up_front(tmp_path, name):
    (tmp_path / name).mkdir()
    assert _unwritable(tmp_path, {}) == (
        f"dump_dir={tmp_path} has a folder named {name}, where the job writes a file; move it away")


def test_a_step_after_a_suspension_finds_the_takeover_before_the_heartbeat_does(tmp_path, monkeypatch):
    """Resumed from SIGSTOP, the main thread may reach its next step before the heartbeat thread looks at the
    lock: check_owned reads it itself."""
    monkeypatch.setattr(dump_dir, "HEARTBEAT_S", 3600.0)  # the heartbeat thread never looks here
    lock = DumpDirLock(tmp_path, "sleeper")
    assert lock.acquire() is None
    lock.check_owned()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": "elsewhere", "pid": 7, "job": "newcomer", "since": 0}))
    with pytest.raises(ConfigError, match=r"its lock was taken over by job newcomer \(host elsewhere, pid 7\)"):
        lock.check_owned()
    lock.release()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["job"] == "newcomer"


def test_a_dump_dir_in_a_checkpoint_folder_is_refused_before_it_changes_the_checkpoint(tmp_path):
    """Its train_config.json and job files would overwrite or join the checkpoint's, which its manifest's
    checksums vouch for: the checkpoint would no longer load."""
    step = tmp_path / "run" / "checkpoints" / "step_2"
    step.mkdir(parents=True)
    (step / "manifest.json").write_text("{}")
    for dump in (step, step / "sub" / "run"):
        problem = _unwritable(dump, {})
        assert problem == (f"dump_dir={dump} is inside the checkpoint {step} (it holds manifest.json): the job's "
                           "outputs would change that checkpoint's files, which its manifest vouches for; use another "
                           "dump_dir")
    assert _unwritable(tmp_path / "run", {}) is None and _unwritable(tmp_path / "run" / "checkpoints", {}) is None
