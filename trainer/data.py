"""The data facade the trainer uses: source files -> cached tokenizer + packed tokens -> microbatches.

Preparation (tokenizer training, tokenizing) runs once, on the main rank, into a cache keyed by the
inputs; other ranks wait for it by polling the filesystem rather than in a collective, so a long first
preparation can never trip a collective timeout, and for as long as the main rank's heartbeat file
shows it is still at work (trainer/heartbeat.py), so it never trips a fixed deadline either. With no
`data.source` the trainer uses the Python standard library's own source: real text that is on every
machine, with no download.
"""

import hashlib
import json
import os
import sysconfig
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

from parallel.errors import ConfigError
from trainer.dump_dir import write_problem
from trainer.heartbeat import Heartbeat, ProgressWatch
from trainer.sampler import GlobalBatchSampler, HeldOutSampler, per_rank_batch_size
from trainer.token_shards import (
    SOURCE_CHANGED,
    PackedTokens,
    is_complete,
    remove_killed_writes,
    sources_fingerprint,
    write_packed_tokens,
)
from trainer.tokenizer import (
    Tokenizer, check_trainable_vocab_size, not_text_reason, train_tokenizer, trainer_settings_fingerprint,
)

SOURCE_SUFFIXES = (".txt", ".jsonl", ".md", ".py")
# Test suites are left out of the default corpus: they are huge, repetitive and full of odd encodings.
EXCLUDED_STDLIB_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
# Bump when the cache layout or packing format changes, so old caches are not reused.
# 2: meta.json records the packed tokens' sha256; documents are packed byte-exact, empty ones dropped.
# 3: the sources' fingerprint reads small files whole and 16 pages of larger ones; suffixes in any case.
CACHE_VERSION = 3
# A waiting rank trusts an error marker older than itself only once it outlives this grace period:
# a live main rank deletes stale markers as it starts, a main rank that already failed does not.
STALE_MARKER_GRACE_S = 10.0


def default_corpus_files() -> list[Path]:
    """The standard library's .py files (no site-packages, no test suites), sorted by relative path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        # Pruned during the walk: site-packages alone can be far larger than the stdlib.
        subfolders[:] = [name for name in subfolders if name not in EXCLUDED_STDLIB_DIRS]
        files.extend(Path(folder) / name for name in names if name.endswith(".py"))
    return sorted(files, key=lambda path: str(path.relative_to(root)))


class SourceFiles(NamedTuple):
    files: list[Path]  # to train on, sorted by name
    left_out: list[Path]  # visible files under the folder, left out for their suffix
    links: dict[Path, Path]  # a name left out -> the name its file is read under (linked twice)


def list_source(source: str | None) -> SourceFiles:
    """`data.source`'s files; None or "stdlib": the default corpus."""
    if source is None or source == "stdlib":
        return SourceFiles(default_corpus_files(), [], {})
    root = Path(source).expanduser()
    if not root.exists():
        broken = root.is_symlink()  # exists() follows links: a dangling or looping link reads as absent
        raise ConfigError(f"data.source={source} {'is a link that leads nowhere' if broken else 'does not exist'}")
    if root.is_file():
        _check_text_file(root, source)
        return SourceFiles([root], [], {})
    if not root.is_dir():
        raise ConfigError(f"data.source={source} is neither a file nor a folder (a pipe, socket or device)")
    visible = [path for path in _visible_files_under(root) if path.is_file()]
    files = [path for path in visible if _is_source_suffix(path)]
    if not files:
        raise ConfigError(f"data.source={source} contains no {'/'.join(SOURCE_SUFFIXES)} files")
    by_name = partial(_relative_name, root)
    left_out = sorted((path for path in visible if not _is_source_suffix(path)), key=by_name)
    once, links = _once_each(sorted(files, key=by_name))
    return SourceFiles(once, left_out, links)


def _once_each(files: list[Path]) -> tuple[list[Path], dict[Path, Path]]:
    """A file linked under several names is read once, under its first name in order: read twice it
    would be trained on twice, and a copy sorted last would land in the held-out tail. Returns the
    names read and, for each name dropped, the name its file is read under."""
    first_name, once, links = {}, [], {}
    for path in files:
        stat = path.stat()
        identity = (stat.st_dev, stat.st_ino) if stat.st_ino else path.resolve()  # 0: no inode numbers
        if identity in first_name:
            links[path] = first_name[identity]
        else:
            first_name[identity] = path
            once.append(path)
    return once, links


def _is_source_suffix(path: Path) -> bool:
    return path.suffix.lower() in SOURCE_SUFFIXES  # NOTES.TXT is text as notes.txt is


def _relative_name(root: Path, path: Path) -> str:
    return str(path.relative_to(root))


def _check_text_file(path: Path, source: str) -> None:
    """A file named on its own is checked on every rank before anything else; a folder's files are
    filtered by suffix here and checked as the main rank reads them (tokenizer.iter_documents)."""
    if not _is_source_suffix(path):
        raise ConfigError(f"data.source={source} is not a {'/'.join(SOURCE_SUFFIXES)} file")
    reason = not_text_reason(path)
    if reason is not None:
        raise ConfigError(f"data.source={source} {reason}")


def _visible_files_under(root: Path) -> list[Path]:
    """Every file under `root` outside hidden folders (.git, .venv, .cache hold tooling, not training
    text), following symlinked folders as a corpus assembled from links needs; each real folder is
    read once, so a link loop ends, under the first of its names in sorted order (the walk visits
    subfolders sorted, so the names, and the document order, do not depend on the filesystem)."""
    seen, files = set(), []
    for folder, subfolders, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        if real in seen:
            subfolders[:] = []
            continue
        seen.add(real)
        subfolders[:] = sorted(name for name in subfolders if not name.startswith("."))
        files.extend(Path(folder) / name for name in names if not name.startswith("."))
    return files


class _CachePaths:
    """Where one (sources, vocab size, tokenizer) combination lives in the cache."""

    def __init__(self, cache_dir: Path, key: str) -> None:
        self.tokenizer = Path(cache_dir) / f"tokenizer-{key}" / "spm.model"
        self.tokens = Path(cache_dir) / f"tokens-{key}"
        self.error = Path(cache_dir) / f"error-{key}.json"
        self.progress = Path(cache_dir) / f"progress-{key}"  # the main rank's heartbeat while it builds

    def complete(self, tokenizer_given: bool) -> bool:
        return is_complete(self.tokens) and (tokenizer_given or self.tokenizer.is_file())


def _cache_key(sources: str, vocab_size: int, tokenizer: Tokenizer | None) -> str:
    # A given tokenizer is keyed by content, so replacing the file at the same path rebuilds.
    recipe = tokenizer.sha256 if tokenizer else trainer_settings_fingerprint()
    parts = [CACHE_VERSION, sources, vocab_size, recipe]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def _load_given_tokenizer(tokenizer_path: str | Path | None, vocab_size: int) -> Tokenizer | None:
    if tokenizer_path is None:
        return None
    path = Path(tokenizer_path).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.tokenizer={tokenizer_path} {'is not a file' if path.exists() else 'does not exist'}")
    tokenizer = Tokenizer(path)
    if tokenizer.bos_id < 0 or tokenizer.eos_id < 0:
        raise ConfigError(f"data.tokenizer={tokenizer_path} has no bos/eos pieces; packing needs both")
    if tokenizer.vocab_size != vocab_size:
        raise ConfigError(
            f"model.vocab_size={vocab_size} does not match data.tokenizer={tokenizer_path} "
            f"(vocab size {tokenizer.vocab_size})"
        )
    return tokenizer


def prepare_dataset(
    source: str | None,
    tokenizer_path: str | Path | None,
    vocab_size: int,
    cache_dir: Path,
    is_main_rank: bool,
    log: Callable[[str], None],
    timeout_s: float = 3600,
    agree: Callable[[str], None] = lambda key: None,
) -> tuple[Tokenizer, PackedTokens]:
    """Returns the tokenizer and packed tokens for `source`, building the cache on the main rank once.

    Every rank validates the source and a given tokenizer first, so bad input fails on all ranks at
    once; `agree(cache key)` then raises on every rank unless all ranks computed the same key (a rank
    that saw other files would wait for a cache the main rank never builds). Non-main ranks then wait
    (silently) for the main rank's cache or its error marker, giving up after `timeout_s` in which the
    main rank's heartbeat did not change.
    """
    if tokenizer_path is None:  # said now, not after the source is read
        check_trainable_vocab_size(vocab_size)
    files, left_out, links = list_source(source)
    given = _load_given_tokenizer(tokenizer_path, vocab_size)
    sources = sources_fingerprint(files)
    key = _cache_key(sources, vocab_size, given)
    agree(key)
    paths = _CachePaths(Path(cache_dir), key)
    if paths.complete(given is not None):  # nothing is written: a complete cache may be on a read-only mount
        if is_main_rank:
            log(f"data: cached {paths.tokens}")
    elif is_main_rank:
        problem = write_problem(Path(cache_dir))
        if problem is not None:
            raise ConfigError(f"data.cache_dir={cache_dir} {problem} (the main rank builds the cache there)")
        # Before anything slow: a marker left by an earlier failed run must not stop waiting ranks.
        paths.error.unlink(missing_ok=True)
        if left_out:
            log(f"data: left out {len(left_out)} file(s) under data.source={source} that are not "
                f"{'/'.join(SOURCE_SUFFIXES)}, e.g. {left_out[0]}")
        if links:
            link, kept = next(iter(links.items()))
            log(f"data: read {len(links)} file(s) under data.source={source} once though linked under several names, "
                f"e.g. {link} (read as {kept})")
        with Heartbeat(paths.progress, timeout_s):
            _build_or_mark_error(files, sources, vocab_size, given, paths, log)
    else:
        _wait_for_main_rank(paths, given is not None, timeout_s)
    tokenizer = given or Tokenizer(paths.tokenizer)
    tokens = PackedTokens(paths.tokens)
    if tokens.meta["tokenizer_sha256"] != tokenizer.sha256:
        # e.g. the tokenizer folder was deleted and trained again by another sentencepiece version.
        raise ConfigError(f"data.cache_dir: {paths.tokens} was packed with another tokenizer than "
                          f"{tokenizer.model_path}; delete {paths.tokens} to pack the data again")
    return tokenizer, tokens


def _build_or_mark_error(
    files: list[Path],
    sources: str,
    vocab_size: int,
    given: Tokenizer | None,
    paths: _CachePaths,
    log: Callable[[str], None],
) -> None:
    try:
        _build(files, sources, vocab_size, given, paths, log)
    except Exception as exc:
        _write_error_marker(paths.error, exc)
        raise


def _build(
    files: list[Path],
    sources: str,
    vocab_size: int,
    given: Tokenizer | None,
    paths: _CachePaths,
    log: Callable[[str], None],
) -> None:
    log(f"data: preparing {len(files)} files into {paths.tokens}")
    remove_killed_writes(paths.tokens, log)  # first: a killed write can be as large as the tokens
    tokenizer = given
    if tokenizer is None:
        if not paths.tokenizer.is_file():
            start = time.monotonic()
            log(f"data: training a BPE tokenizer, vocab_size={vocab_size}")
            train_tokenizer(files, vocab_size, paths.tokenizer)
            if sources_fingerprint(files) != sources:  # trained on text the tokens would not be packed from
                paths.tokenizer.unlink()
                raise ConfigError(SOURCE_CHANGED)
            log(f"data: tokenizer trained in {time.monotonic() - start:.1f} s")
        tokenizer = Tokenizer(paths.tokenizer)
    start = time.monotonic()
    write_packed_tokens(files, tokenizer, paths.tokens, progress=log, num_threads=usable_cores(), sources=sources)
    log(f"data: tokenized in {time.monotonic() - start:.1f} s")


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a job's cgroup or taskset may grant fewer than the
    machine has); every core where the platform has no affinity (macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _write_error_marker(marker: Path, exc: Exception) -> None:
    marker.parent.mkdir(parents=True, exist_ok=True)
    tmp = marker.with_name(f".{marker.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"type": type(exc).__name__, "message": str(exc).strip()}))
    os.replace(tmp, marker)


def _wait_for_main_rank(paths: _CachePaths, tokenizer_given: bool, timeout_s: float) -> None:
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


class BatchLoader:
    """Turns a step's sequence indices for this data-parallel rank into (inputs, targets) microbatches."""

    def __init__(
        self,
        tokens: PackedTokens,
        sampler: GlobalBatchSampler | HeldOutSampler,
        seq_len: int,
        dp_rank: int,
        dp_size: int,
        microbatch_size: int,
        document_start_id: int | None = None,
    ) -> None:
        """`document_start_id`: the token that starts each packed document (the tokenizer's bos), for
        document_ids."""
        self.per_rank_batch = per_rank_batch_size(sampler.global_batch_size, dp_size)
        if microbatch_size < 1 or self.per_rank_batch % microbatch_size:
            raise ConfigError(
                f"microbatch_size={microbatch_size} must divide batch_size={self.per_rank_batch}"
            )
        self.tokens, self.sampler, self.seq_len = tokens, sampler, seq_len
        self.dp_rank, self.dp_size, self.microbatch_size = dp_rank, dp_size, microbatch_size
        self.document_start_id = document_start_id

    def batch(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches of step `step` (0-based): [microbatch_size, seq_len] int64 each."""
        indices = self.sampler.rank_indices(step, self.dp_rank, self.dp_size)
        windows = torch.from_numpy(np.stack([self.tokens.sequence(int(i), self.seq_len) for i in indices]))
        size = self.microbatch_size
        return [
            (windows[i : i + size, :-1].contiguous(), windows[i : i + size, 1:].contiguous())
            for i in range(0, len(indices), size)
        ]

    def document_ids(self, inputs: torch.Tensor) -> torch.Tensor:
        """[b, s] index of each input token's document within its sequence. The packer writes `bos doc eos`,
        so a document starts at each bos; a window that opens inside a document holds its tail as 0."""
        if self.document_start_id is None:
            raise ValueError("this loader was built without document_start_id: it cannot tell documents apart")
        return (inputs == self.document_start_id).cumsum(dim=1)
