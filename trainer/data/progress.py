"""The packing's progress line: a bar, files, MB read of MB stored, MB/s of text, ETA, tokens. Throttled
to one line per PROGRESS_STEP of the input and per PROGRESS_MIN_INTERVAL_S, the job's log and
scripts/prepare_data.py's stderr show the same lines."""

import time
from collections.abc import Callable

PROGRESS_STEP = 0.05
PROGRESS_MIN_INTERVAL_S = 1.0
BAR_WIDTH = 20


class Progress:
    """`total_bytes`: the sources as stored (compressed, Parquet: what the files weigh); the position is read
    in those bytes, the rate in bytes of text (or of token ids, for a tokenized source)."""

    def __init__(self, total_files: int, total_bytes: int, report: Callable[[str], None]) -> None:
        self.total_files, self.total_bytes, self._report = total_files, max(total_bytes, 1), report
        self.files = self.position = self.text_bytes = self.tokens = 0
        self._start = self._last_time = time.monotonic()
        self._next_fraction = PROGRESS_STEP

    def update(self, files: int, position: int, text_bytes: int, tokens: int) -> None:
        """`files` more files done, the input read up to stored byte `position`, `text_bytes` more text packed
        into `tokens` more tokens."""
        self.files += files
        self.position = max(self.position, position)
        self.text_bytes += text_bytes
        self.tokens += tokens
        fraction = self.position / self.total_bytes
        now = time.monotonic()
        if fraction >= self._next_fraction and now - self._last_time >= PROGRESS_MIN_INTERVAL_S:
            self._next_fraction = fraction + PROGRESS_STEP
            self._last_time = now
            self._report(self.line(min(fraction, 0.99)))

    def finish(self) -> None:
        self.position = self.total_bytes
        self._report(self.line(1.0))

    def line(self, fraction: float) -> str:
        elapsed = max(time.monotonic() - self._start, 1e-9)
        filled = round(fraction * BAR_WIDTH)
        eta = f"ETA {_duration(elapsed * (1 - fraction) / fraction)}" if 0 < fraction < 1 else \
            f"in {_duration(elapsed)}" if fraction >= 1 else "ETA ?"
        return (f"data: tokenized [{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {fraction:.0%} "
                f"{self.files}/{self.total_files} files, {self.position / 1e6:.1f}/{self.total_bytes / 1e6:.1f} MB, "
                f"{self.text_bytes / 1e6 / elapsed:.1f} MB/s, {eta}, {self.tokens / 1e6:.2f}M tokens")


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}" if seconds >= 3600 else \
        f"{seconds // 60}:{seconds % 60:02d}"
