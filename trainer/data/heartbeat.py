"""A file that shows other processes that a long piece of work is still going on.

The main rank prepares the data while the other ranks wait on the shared filesystem, and a first
tokenization of a large corpus can outlast any fixed deadline. So the main rank rewrites this file while
it works, and a waiting rank gives up only after a whole timeout in which the file did not change. The
waiter compares the file's content with what it read before, never a time in it with its own clock
(nodes' clocks may disagree), and reads it with open(), which NFS revalidates, unlike a stat's mtime.
"""

import os
import threading
import time
from pathlib import Path

# A short timeout beats faster, so a waiter sees several beats per timeout; never in a busy loop.
BEATS_PER_TIMEOUT = 4
MIN_BEAT_INTERVAL_S, MAX_BEAT_INTERVAL_S = 0.05, 10.0


class Heartbeat:
    """Rewrites `path` from a background thread while the `with` block runs, and removes it after."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path = Path(path)
        self.interval_s = min(max(timeout_s / BEATS_PER_TIMEOUT, MIN_BEAT_INTERVAL_S), MAX_BEAT_INTERVAL_S)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat {self.path.name}", daemon=True)

    def __enter__(self) -> "Heartbeat":
        self._beat(0)
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()
        self.path.unlink(missing_ok=True)

    def _run(self) -> None:
        count = 1
        while not self._stop.wait(self.interval_s):
            try:
                self._beat(count)
            except OSError:
                pass  # a full disk or a network blip: the next beat tries again, a waiter's timeout covers it
            count += 1

    def _beat(self, count: int) -> None:
        # The pid tells this writer's beats from a killed one's that left the file behind.
        self.path.write_text(f"{os.getpid()} {count}\n")


class ProgressWatch:
    """A waiter's deadline, `timeout_s` after it last saw the heartbeat file change (or after it started)."""

    def __init__(self, path: Path, timeout_s: float) -> None:
        self.path, self.timeout_s = Path(path), timeout_s
        self._seen = self._read()
        self._deadline = time.monotonic() + timeout_s

    def expired(self) -> bool:
        beat = self._read()
        if beat != self._seen:
            self._seen, self._deadline = beat, time.monotonic() + self.timeout_s
        return time.monotonic() > self._deadline

    def _read(self) -> str | None:
        try:
            return self.path.read_text()
        except OSError:  # not written yet, or removed as the work ended
            return None
