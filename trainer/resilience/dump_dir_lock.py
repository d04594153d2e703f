"""A dump_dir belongs to one job: it must be writable, and a lock that dies with its holder keeps a
second job (a duplicate launch, a sweep pointed at one folder) from writing into it.

The lock is `{dump_dir}/.lock`, created exclusively (O_EXCL, which shared filesystems honour) by the
job's rank 0 and holding who owns it. The holder touches it every few seconds; a lock whose holder is a
dead process on this host (same host name, boot and pid namespace: containers that share a host name
see other processes, or none, under a pid), or whose heartbeat stopped (a holder on another node that
died), or an earlier attempt of the same torchrun job (its restart, which may put rank 0 on another
node, comes only after torchrun stopped every worker of that attempt), is stale and taken over.
Anything else is a live job, and the newcomer is refused in one line naming it. A holder whose lock
was taken over meanwhile (it was silent that long: suspended) stops at its next step. Whether a holder
that is not a process of this host beats is seen by watching its lock, never by comparing its time stamp
with this host's clock (its node's clock, or the file server's, may be far from ours either way): a lock
that looks stale by our clock is watched for a few heartbeats (a live holder touches it meanwhile), one
that looks fresh until it is touched (at most a heartbeat for a live holder) or until STALE_AFTER_S of
silence (a holder that died, stamped by a clock ahead of ours).

Only one newcomer at a time judges and removes a stale lock, inside `{dump_dir}/.lock.takeover` (also
created exclusively): two newcomers that both found the lock stale would otherwise both remove it, the
second removing the first's fresh lock, and both would write into the folder. A takeover guard left by a
newcomer that died during its takeover is removed once it is STALE_AFTER_S old.
"""

import json
import os
import socket
import threading
import time
from pathlib import Path

from torch.distributed import ProcessGroup

from parallel import comm
from parallel.errors import ConfigError
from trainer.checkpoint.files import MANIFEST, enclosing_checkpoint
from trainer.outputs import JOB_FILES, LOCK_FILE, TAKEOVER_FILE, write_problem

TAKEOVER_RETRY_S = 0.1
HEARTBEAT_S = 2.0
STALE_AFTER_S = 30.0
# A lock that looks stale by this host's clock is watched this long: a live holder touches it meanwhile
# (its node's clock, or the file server's, may be far from ours).
STALE_CONFIRM_S = 2.5 * HEARTBEAT_S
WATCH_POLL_S = 0.1


class DumpDirLock:
    def __init__(self, dump_dir: Path, job: str, attempt: int = 0):
        """`job`: torchrun's run id; `attempt`: its restart count."""
        self.path = Path(dump_dir) / LOCK_FILE
        self.owner = {"host": socket.gethostname(), "pids": _pid_namespace(), "pid": os.getpid(), "job": job,
                      "attempt": attempt, "since": time.time()}
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None
        self.lost: str | None = None  # set by the heartbeat: how the lock stopped being this job's

    def acquire(self) -> str | None:
        """Take the lock; returns None, or a description of the live job that holds it."""
        # A stale lock is removed and the create retried (another taker may win); another newcomer's
        # takeover takes at most STALE_CONFIRM_S.
        deadline = time.monotonic() + 3 * STALE_CONFIRM_S + 1.0
        while True:
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                if time.monotonic() > deadline:
                    return "another job that is taking it over"
                holder = self._remove_if_stale()
                if holder is not None:
                    return holder
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(self.owner, f)
            self._heartbeat = threading.Thread(target=self._beat, name="dump-dir-lock", daemon=True)
            self._heartbeat.start()
            return None

    def _remove_if_stale(self) -> str | None:
        """Under the takeover guard: remove the lock if it is stale; returns its live holder otherwise.
        None also when another newcomer holds the guard (the caller retries)."""
        guard = self.path.with_name(TAKEOVER_FILE)
        try:
            os.close(os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            if _age(guard) > STALE_AFTER_S:
                guard.unlink(missing_ok=True)
            else:
                time.sleep(TAKEOVER_RETRY_S)
            return None
        try:
            holder = self._holder(guard)
            if holder is None:
                self.path.unlink(missing_ok=True)
            return holder
        finally:
            guard.unlink(missing_ok=True)

    def _holder(self, guard: Path) -> str | None:
        """The live holder's description; None if the lock is stale. `guard`: the takeover guard held
        meanwhile (kept fresh while the lock is watched)."""
        try:
            mtime = self.path.stat().st_mtime
            owner = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:  # being written right now: live unless it stays unreadable
            return None if time.time() - mtime > STALE_AFTER_S else "a job that is starting"
        if owner.get("job") == self.owner["job"] and owner.get("attempt", self.owner["attempt"]) < self.owner["attempt"]:
            return None
        if (owner.get("host"), owner.get("pids")) == (self.owner["host"], self.owner["pids"]):
            beats = _alive(int(owner.get("pid", -1)))  # a process of this host: asked directly
        else:
            looks_stale = time.time() - mtime > STALE_AFTER_S
            beats = self._touched_within(mtime, STALE_CONFIRM_S if looks_stale else STALE_AFTER_S, guard)
        if not beats:
            return None
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("since", 0)))
        return f"job {owner.get('job')} (host {owner.get('host')}, pid {owner.get('pid')}, since {since})"

    def _touched_within(self, mtime: float, seconds: float, guard: Path) -> bool:
        """Whether the lock's time stamp changes within `seconds` (returns as soon as it does)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            time.sleep(WATCH_POLL_S)
            try:
                if self.path.stat().st_mtime != mtime:
                    return True
            except FileNotFoundError:
                return False
            os.utime(guard)  # a newcomer waiting on the guard sees a takeover in progress, not a dead one
        return False

    def _beat(self) -> None:
        """Touch the lock while it is this job's; note when it stops being so (`lost`)."""
        while not self._stop.wait(HEARTBEAT_S):
            if self._lost_now():
                return
            try:
                os.utime(self.path)
            except FileNotFoundError:
                self.lost = "removed"
                return

    def _lost_now(self) -> bool:
        """Read the lock: if it is no longer this job's, note how (`lost`) and say so."""
        try:
            holder = json.loads(self.path.read_text())
        except FileNotFoundError:
            holder = None
        except ValueError:
            return False  # a newcomer is writing its own: judged at the next look
        if holder != self.owner:
            self.lost = "removed" if holder is None else f"taken over by job {holder.get('job')} " \
                f"(host {holder.get('host')}, pid {holder.get('pid')})"
        return self.lost is not None

    def check_owned(self) -> None:
        """Raise if the lock stopped being this job's: its heartbeat was silent past STALE_AFTER_S (the
        job suspended, its node's filesystem stalled) and another job took the dump_dir over, or the
        lock file was removed. Writing on would mix two jobs' outputs. The lock is read here too: a job
        resumed from a suspension can reach its next step before its heartbeat thread looks."""
        if self.lost is None and self._heartbeat is not None:
            self._lost_now()
        if self.lost is not None:
            raise ConfigError(f"dump_dir={self.path.parent}: its lock was {self.lost} while this job ran; stopping "
                              f"before writing into it again (a lock silent for {STALE_AFTER_S:.0f} s counts as a "
                              f"dead job's)")

    def release(self) -> None:
        if self._heartbeat is None:
            return
        self._stop.set()
        self._heartbeat.join()
        self._heartbeat = None
        try:  # only this job's own lock: another job's may carry the same pid (another node, a container)
            if self.lost is None and json.loads(self.path.read_text()) == self.owner:
                self.path.unlink()
        except (FileNotFoundError, ValueError):
            pass


def _age(path: Path) -> float:
    try:
        return time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return 0.0


def _pid_namespace() -> str | None:
    """Where this process's pid means this process: the boot and the pid namespace (Linux); else None."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return None


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def own_dump_dir(dump_dir: Path, folders: dict[str, str], rank: int, job: str, attempt: int,
                 group: ProcessGroup) -> DumpDirLock | None:
    """Rank 0 makes dump_dir and its output `folders` (output_folders), checks that it can write there, and
    takes the lock; every rank receives the verdict, so all stop together on the same line. Returns
    the lock on rank 0 (release it when the job ends), None elsewhere."""
    lock, problem = None, None
    if rank == 0:
        problem = _unwritable(dump_dir, folders)
        if problem is None:
            lock = DumpDirLock(dump_dir, job, attempt)
            holder = lock.acquire()
            if holder is not None:
                lock, problem = None, f"dump_dir={dump_dir} is in use by {holder}; let it finish, stop it, or use another dump_dir"
    problems = [p for p in comm.all_gather_object(problem, group) if p]
    if problems:
        if lock is not None:
            lock.release()
        raise ConfigError(problems[0])
    return lock


def _unwritable(dump_dir: Path, folders: dict[str, str]) -> str | None:
    """Why the job could not write its outputs (None if it can), found before any work is done."""
    checkpoint = enclosing_checkpoint(dump_dir)
    if checkpoint is not None:
        return (f"dump_dir={dump_dir} is inside the checkpoint {checkpoint} (it holds {MANIFEST}): the job's outputs "
                "would change that checkpoint's files, which its manifest vouches for; use another dump_dir")
    problem = write_problem(dump_dir)
    if problem is not None:
        return f"dump_dir={dump_dir} {problem}"
    for name, setting in folders.items():
        problem = write_problem(dump_dir / name)
        if problem is not None:
            return f"dump_dir (its {name}/ folder, {setting})={dump_dir / name} {problem}"
    folders_in_the_way = [name for name in JOB_FILES if (dump_dir / name).is_dir()]
    if folders_in_the_way:
        return (f"dump_dir={dump_dir} has a folder named {folders_in_the_way[0]}, where the job writes a file; "
                f"move it away")
    return None
