"""Preparing the data cache: source files -> tokenizer (given, or trained on the sources) -> packed tokens.

Preparation runs once, on the main rank, into the cache folder of its inputs (cache.py); every other
rank validates the same inputs, then waits for that folder.
"""

import os
import time
from collections.abc import Callable
from pathlib import Path

from parallel.errors import ConfigError
from trainer.config.vocab import VocabPadding
from trainer.data.cache import CachePaths, cache_key, marking_errors, wait_for_main_rank
from trainer.data.heartbeat import Heartbeat
from trainer.data.records import RecordFormat, check_skipped
from trainer.data.shards import PackedTokens, is_complete, remove_killed_writes, write_packed_tokens
from trainer.data.sources import (KINDS, SOURCE_CHANGED, list_source, reads_keyed_records, source_kind,
                                  sources_fingerprint)
from trainer.data.tokenizer import Tokenizer, load_given_tokenizer, missing_tokenizer
from trainer.data.tokenizer_spm import SentencePieceTokenizer, check_trainable_vocab_size, train_tokenizer
from trainer.outputs import write_problem


def prepare_dataset(
    source: str | None,
    tokenizer_path: str | Path | None,
    vocab_size: int,
    cache_dir: Path,
    is_main_rank: bool,
    log: Callable[[str], None],
    timeout_s: float = 3600,
    agree: Callable[[str], None] = lambda key: None,
    tokenizer_key: str = "data.tokenizer",
    tokenizer_origin: str | None = None,
    padding: VocabPadding | None = None,
    fmt: RecordFormat = RecordFormat(),
    workers: int | None = None,
) -> tuple[Tokenizer, PackedTokens]:
    """Returns the tokenizer and packed tokens for `source`, building the cache on the main rank once.

    Every rank validates the source and a given tokenizer first, so bad input fails on all ranks at
    once; `agree(cache key)` then raises on every rank unless all ranks computed the same key (a rank
    that saw other files would wait for a cache the main rank never builds). Non-main ranks then wait
    (silently) for the main rank's cache or its error marker, giving up after `timeout_s` in which the
    main rank's heartbeat did not change. `tokenizer_key` names where `tokenizer_path` came from, and
    `tokenizer_origin` whose tokenizer it is where no setting named it (TokenizerChoice.origin).
    `vocab_size` is model.vocab_size: the size of a tokenizer trained here, and at least a given one's
    (`padding`: make_vocab_size_divisible_by's rule, trainer/config/vocab.py). `fmt`: how documents are
    read (data.text_key, data.bad_records, data.max_bad_fraction); every rank checks the bad records the
    packed tokens skipped against it, cached or not. `workers`: the processes that tokenize
    (data.prepare_workers; None: every usable core).
    """
    if tokenizer_path is None:  # said now, not after the source is read
        check_trainable_vocab_size(vocab_size)
    files, left_out, links = list_source(source)
    if tokenizer_path is None:
        _check_tokenized_sources(files)
    given = load_given_tokenizer(tokenizer_path, vocab_size, tokenizer_key, padding, tokenizer_origin)
    sources = sources_fingerprint(files)
    key = cache_key(sources, vocab_size, given, fmt.text_key if reads_keyed_records(files) else "text")
    agree(key)
    paths = CachePaths(Path(cache_dir), key)
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
            log(f"data: left out {len(left_out)} file(s) under data.source={source} that are none of {KINDS}, "
                f"e.g. {left_out[0]}")
        if links:
            link, kept = next(iter(links.items()))
            log(f"data: read {len(links)} file(s) under data.source={source} once though linked under several names, "
                f"e.g. {link} (read as {kept})")
        with Heartbeat(paths.progress, timeout_s), marking_errors(paths.error):
            _build(files, sources, vocab_size, given, paths, log, fmt, workers or usable_cores())
    else:
        wait_for_main_rank(paths, given is not None, timeout_s)
    tokenizer = given or trained_tokenizer(paths.tokenizer)
    tokens = PackedTokens(paths.tokens)
    if tokens.meta["tokenizer_sha256"] != tokenizer.sha256:
        # e.g. the tokenizer folder was deleted and trained again by another sentencepiece version.
        raise ConfigError(f"data.cache_dir: {paths.tokens} was packed with another tokenizer than "
                          f"{tokenizer.path}; delete {paths.tokens} to pack the data again")
    skipped = check_skipped(tokens.meta, fmt, paths.tokens)
    if skipped and is_main_rank:
        log(skipped)
    return tokenizer, tokens


def _build(
    files: list[Path],
    sources: str,
    vocab_size: int,
    given: Tokenizer | None,
    paths: CachePaths,
    log: Callable[[str], None],
    fmt: RecordFormat,
    workers: int,
) -> None:
    log(f"data: preparing {len(files)} files into {paths.tokens}")
    remove_killed_writes(paths.tokens, log)  # first: a killed write can be as large as the tokens
    tokenizer = given
    if tokenizer is None:
        if not paths.tokenizer.is_file():
            start = time.monotonic()
            log(f"data: training a BPE tokenizer, vocab_size={vocab_size}")
            train_tokenizer(files, vocab_size, paths.tokenizer, fmt)
            if sources_fingerprint(files) != sources:  # trained on text the tokens would not be packed from
                paths.tokenizer.unlink()
                raise ConfigError(SOURCE_CHANGED)
            log(f"data: tokenizer trained in {time.monotonic() - start:.1f} s")
        tokenizer = trained_tokenizer(paths.tokenizer)
    if is_complete(paths.tokens):  # only the tokenizer was missing (trained again), or another job packed them
        log(f"data: {paths.tokens} is already packed")  # whose tokenizer: checked by the caller
        return
    start = time.monotonic()
    write_packed_tokens(files, tokenizer, paths.tokens, progress=log, num_threads=usable_cores(), sources=sources,
                        fmt=fmt, workers=workers)
    log(f"data: tokenized in {time.monotonic() - start:.1f} s")


def trained_tokenizer(path: Path) -> SentencePieceTokenizer:
    """The tokenizer trained into the cache for data.tokenizer=null, read once (another job sharing
    data.cache_dir, or a user clearing it, may delete it at any time)."""
    origin = "the one trained on data.source into data.cache_dir (data.tokenizer is null)"
    try:
        data = path.read_bytes()
    except FileNotFoundError as e:
        raise ConfigError(missing_tokenizer(path, origin, "while the data was prepared") + "; run again to train it "
                          "anew") from e
    return SentencePieceTokenizer(path, data, f"the tokenizer {path}, {origin},")


def _check_tokenized_sources(files: list[Path]) -> None:
    """Said on every rank before anything slow: token ids are only meaningful with the tokenizer that made them."""
    tokenized = next((path for path in files if source_kind(path) == "megatron"), None)
    if tokenized is not None:
        raise ConfigError(f"data.source {tokenized} is a Megatron indexed dataset, already tokenized: set "
                          "data.tokenizer to the tokenizer that wrote it (data.tokenizer=null trains one on text)")


def usable_cores() -> int:
    """The cores this process may run on (its affinity: a job's cgroup or taskset may grant fewer than the
    machine has); every core where the platform has no affinity (macOS)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
