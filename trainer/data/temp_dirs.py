"""Temporary folders that record their writer, so that those a killed writer left can be reclaimed.

Packed tokens are written under a hidden temporary name and renamed into place once complete
(shards.py); a writer killed with SIGKILL leaves its folder behind, as large as the corpus' tokens,
and nothing else removes it. Each folder records its writer's host and process id when it is made. A
folder is stale when that writer is gone: on this host, its process no longer exists; on another host
(or with no record), nothing was written in it for STALE_AFTER_S. A live writer's folder is never stale.
"""

import glob
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path

WRITER_FILE = "writer.json"
# Generous: a live writer on another host rewrites its tokens every few seconds.
STALE_AFTER_S = 24 * 3600.0


def make_writer_temp_dir(parent: Path, prefix: str) -> Path:
    """A new private folder `parent/prefix*` that records this process as its writer."""
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    (folder / WRITER_FILE).write_text(json.dumps({"host": _this_host(), "pid": os.getpid()}))
    return folder


def remove_stale_temp_dirs(parent: Path, prefix: str) -> list[Path]:
    """Removes the folders `parent/prefix*` whose writer is gone; returns them."""
    candidates = Path(parent).glob(f"{glob.escape(prefix)}*")
    stale = [folder for folder in candidates if folder.is_dir() and _writer_gone(folder)]
    for folder in stale:
        shutil.rmtree(folder, ignore_errors=True)
    return stale


def _writer_gone(folder: Path) -> bool:
    writer = _read_writer(folder)
    if writer is not None and writer["host"] == _this_host():
        return not _alive(writer["pid"])
    return time.time() - _last_write(folder) > STALE_AFTER_S


def _this_host() -> str:
    """The host name and, where there is one, the pid namespace: containers that share a host name (and
    the cache folder) cannot see each other's processes, so they must not judge each other's."""
    try:
        return f"{socket.gethostname()} {os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return socket.gethostname()


def _read_writer(folder: Path) -> dict | None:
    try:
        writer = json.loads((folder / WRITER_FILE).read_text())
    except (OSError, ValueError):
        return None  # made by an older version, or killed before it wrote the record
    # pid 0 or below would address process groups in os.kill: not a writer's record.
    valid = isinstance(writer, dict) and isinstance(writer.get("host"), str) and isinstance(writer.get("pid"), int)
    return writer if valid and writer["pid"] > 0 else None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _last_write(folder: Path) -> float:
    """The newest modification time of the folder and its files; now if it changes under our feet (its
    writer renamed or removed it: alive a moment ago)."""
    try:
        return max([folder.stat().st_mtime] + [entry.stat().st_mtime for entry in os.scandir(folder)])
    except OSError:
        return time.time()
