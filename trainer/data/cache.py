"""The data cache: one folder per (sources, vocab size, tokenizer), built once by the main rank.

The other ranks wait for it by polling the filesystem rather than in a collective, so a long first
preparation can never trip a collective timeout, and for as long as the main rank's heartbeat file
shows it is still at work (heartbeat.py), so it never trips a fixed deadline either. A main rank that
fails leaves an error marker, which the waiting ranks raise as their own.
"""

import hashlib
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from parallel.errors import ConfigError
from trainer.data.heartbeat import ProgressWatch
from trainer.data.shards import is_complete
from trainer.data.tokenizer import Tokenizer
from trainer.data.tokenizer_spm import trainer_settings_fingerprint

# Bump when the cache layout or packing format changes, so old caches are not reused.
# 2: meta.json records the packed tokens' sha256; documents are packed byte-exact, empty ones dropped.
# 3: the sources' fingerprint reads small files whole and 16 pages of larger ones; suffixes in any case.
# 4: JSON lines end at "\n" only (a lone "\r" is whitespace); a tokenizer.json's saved truncation and
#    padding are not applied (they cut or padded documents).
CACHE_VERSION = 4
# A waiting rank trusts an error marker older than itself only once it outlives this grace period:
# a live main rank deletes stale markers as it starts, a main rank that already failed does not.
STALE_MARKER_GRACE_S = 10.0


class CachePaths:
    """Where one (sources, vocab size, tokenizer) combination lives in the cache."""

    def __init__(self, cache_dir: Path, key: str) -> None:
        self.tokenizer = Path(cache_dir) / f"tokenizer-{key}" / "spm.model"
        self.tokens = Path(cache_dir) / f"tokens-{key}"
        self.error = Path(cache_dir) / f"error-{key}.json"
        self.progress = Path(cache_dir) / f"progress-{key}"  # the main rank's heartbeat while it builds

    def complete(self, tokenizer_given: bool) -> bool:
        return is_complete(self.tokens) and (tokenizer_given or self.tokenizer.is_file())


def cache_key(sources: str, vocab_size: int, tokenizer: Tokenizer | None, text_key: str = "text") -> str:
    # A given tokenizer is keyed by content, so replacing the file at the same path rebuilds; and by its own
    # size, not model.vocab_size's: a padded model packs the same tokens.
    recipe = tokenizer.sha256 if tokenizer else trainer_settings_fingerprint()
    parts = [CACHE_VERSION, sources, tokenizer.vocab_size if tokenizer else vocab_size, recipe]
    if text_key != "text":  # another field packs other text; the default adds nothing, so older caches stay valid
        parts.append(text_key)
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


@contextmanager
def marking_errors(marker: Path) -> Iterator[None]:
    """The main rank's build: an error it raises is also written to `marker`, for the waiting ranks."""
    try:
        yield
    except Exception as exc:
        write_error_marker(marker, exc)
        raise


def write_error_marker(marker: Path, exc: Exception) -> None:
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(f".{marker.name}.tmp{os.getpid()}")
    kind = "ConfigError" if isinstance(exc, ConfigError) else type(exc).__name__  # its subclasses too (BadRecord)
    tmp.write_text(json.dumps({"type": kind, "message": str(exc).strip()}))
    os.replace(tmp, marker)


def wait_for_main_rank(paths: CachePaths, tokenizer_given: bool, timeout_s: float) -> None:
    start_wall, progress = time.time(), ProgressWatch(paths.progress, timeout_s)
    interval = 0.05
    while not paths.complete(tokenizer_given):
        _raise_if_main_rank_failed(paths.error, start_wall)
        if progress.expired():
            raise TimeoutError(
                f"data: the main rank did not finish {paths.tokens}, nor show that it was still preparing it, within "
                f"data.prepare_timeout_s={timeout_s:g} s (is the cache folder shared by all ranks? did rank 0 stop?)"
            )
        # At least two looks per timeout: a change seen across a longer gap could hide a quiet spell in it.
        time.sleep(min(interval, timeout_s / 2))
        interval = min(interval * 1.5, 2.0)


def _raise_if_main_rank_failed(marker: Path, waiting_since: float) -> None:
    try:
        written_at = marker.stat().st_mtime
        record = json.loads(marker.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return
    if written_at < waiting_since and time.time() - waiting_since < STALE_MARKER_GRACE_S:
        return
    message = f"data preparation failed on the main rank: {record['message']}"
    raise ConfigError(message) if record["type"] == "ConfigError" else RuntimeError(message)
