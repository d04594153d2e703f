"""Packed token storage: one flat memory-mapped binary of `bos doc eos` runs, plus meta.json.

Tokenizing a corpus is slow and training reads random fixed-length windows of it, so the corpus is
tokenized once into a flat array that every rank memory-maps (no copies, no per-rank RAM). The folder
is written under a temporary name and renamed into place, so a folder with `meta.json` under the
final name is always complete: a killed writer leaves only a temp folder that nothing reads, which the
next build of the same folder removes (temp_dirs.py). `data_fingerprint` is what a checkpoint records of
the packed tokens, so that a resume on changed data is refused.
"""

import hashlib
import json
import os
import shutil
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, NamedTuple

import numpy as np

from parallel.errors import ConfigError
from trainer.data.encode_pool import Document, InlineEncoder, PoolEncoder
from trainer.data.progress import Progress
from trainer.data.records import RecordCount, RecordFormat, iter_records
from trainer.data.sources import SOURCE_CHANGED, sources_fingerprint, stored_size
from trainer.data.temp_dirs import WRITER_FILE, make_writer_temp_dir, remove_stale_temp_dirs
from trainer.data.tokenizer import Tokenizer

TOKENS_FILE = "tokens.bin"
META_FILE = "meta.json"
# Characters (or token ids) per batch encoded at once: big enough to amortize the call and the trip to a
# worker, small enough for RAM with two batches a worker in flight.
BATCH_CHARS = 4 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 65535 else np.uint32)


def is_complete(out_dir: Path) -> bool:
    """A packed folder exists under its final name only once fully written (see module doc)."""
    return (Path(out_dir) / META_FILE).is_file()


class PublishedMeanwhile(Exception):
    """Another writer (a job sharing data.cache_dir) published the folder being packed."""


class _Packer:
    """Batches documents, has them encoded (in this process or by workers) and appends each batch's
    `bos ids eos` runs to the open file in the order the documents came. Stops with PublishedMeanwhile
    once another writer has published `final` (the ranks waiting on this one already read theirs)."""

    def __init__(self, tokenizer: Tokenizer, out: BinaryIO, dtype: np.dtype, progress: Progress,
                 encoder: InlineEncoder | PoolEncoder, batch_chars: int, final: Path) -> None:
        self._tokenizer, self._out, self._dtype, self._progress = tokenizer, out, dtype, progress
        self._final = final
        self._encoder, self._batch_chars = encoder, batch_chars
        self._pending: list[Document] = []
        self._pending_chars = self._pending_files = self._pending_bytes = 0
        self._file_start = self._file_size = self._file_bytes = 0  # the current file, in stored bytes
        self._in_flight: deque = deque()
        self.num_tokens = self.num_documents = 0
        self.digest = hashlib.sha256()  # of every byte written: the whole corpus' hash at no extra read

    def start_file(self, size: int) -> None:
        self._file_size, self._file_bytes = size, 0

    def add(self, document: str | np.ndarray, where: Path) -> None:
        if isinstance(document, np.ndarray):
            size = document.nbytes
            document = self._checked_ids(document, where)
            if not len(document):
                return
        else:
            size = len(document.encode("utf-8"))
        self._pending.append(document)
        self._pending_chars += len(document)
        self._pending_bytes += size
        self._file_bytes += size
        if self._pending_chars >= self._batch_chars:
            self._submit()

    def end_file(self) -> None:
        self._pending_files += 1
        self._file_start += self._file_size
        self._file_size = self._file_bytes = 0

    def finish(self) -> None:
        if self._pending or self._pending_files:  # files ended after the last batch still count as done
            self._submit()
        while self._in_flight:
            self._write_next()

    def _checked_ids(self, ids: np.ndarray, where: Path) -> np.ndarray:
        """A tokenized document's ids, checked against the tokenizer, without the bos and eos packing adds
        (Megatron's preprocess_data.py --append-eod ends each document with eos): the same run of tokens
        as its text packs into."""
        vocab = self._tokenizer.vocab_size
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise ConfigError(f"data.source {where} holds token id {bad}, outside data.tokenizer's {vocab} ids: "
                              "it was tokenized with another tokenizer")
        start = 1 if ids.size and ids[0] == self._tokenizer.bos_id else 0
        end = ids.size - 1 if ids.size > start and ids[-1] == self._tokenizer.eos_id else ids.size
        return ids[start:end]

    def _submit(self) -> None:
        position = self._file_start + min(self._file_bytes, self._file_size)
        result = self._encoder.submit(self._pending)
        self._in_flight.append((result, self._pending_files, position, self._pending_bytes, len(self._pending)))
        self._pending, self._pending_chars, self._pending_files, self._pending_bytes = [], 0, 0, 0
        while len(self._in_flight) > 2 * self._encoder.workers:  # inline: written at once
            self._write_next()

    def _write_next(self) -> None:
        if is_complete(self._final):  # one stat a batch
            raise PublishedMeanwhile
        result, files, position, text_bytes, documents = self._in_flight.popleft()
        packed = result().tobytes()
        self._out.write(packed)
        self.digest.update(packed)
        tokens = len(packed) // self._dtype.itemsize
        self.num_tokens += tokens
        self.num_documents += documents
        self._progress.update(files, position, text_bytes, tokens)


def write_packed_tokens(
    text_files: list[Path],
    tokenizer: Tokenizer,
    out_dir: Path,
    progress: Callable[[str], None],
    num_threads: int = 2,
    *,
    sources: str,
    fmt: RecordFormat = RecordFormat(),
    workers: int = 1,
    batch_chars: int = BATCH_CHARS,
) -> Path:
    """Tokenizes `text_files` into `out_dir` (tokens.bin + meta.json), atomically. `sources` is their
    sources_fingerprint when the caller decided to pack them (the cache key's): files that changed
    since (written to during tokenizer training or packing) are refused rather than published. `fmt`: how
    documents are read; meta.json records the bad records skipped. `workers` > 1: encoded in that many
    worker processes when there is more than one batch of `batch_chars` (the same bytes as one process,
    which encodes with `num_threads` tokenizer threads)."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = make_writer_temp_dir(out_dir.parent, _temp_prefix(out_dir))
    try:
        meta = _write_tokens(text_files, tokenizer, tmp_dir / TOKENS_FILE, progress, fmt,
                             _Encoding(num_threads, workers, batch_chars), out_dir)
        if meta["sources_fingerprint"] != sources:
            raise ConfigError(SOURCE_CHANGED)
        (tmp_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        (tmp_dir / WRITER_FILE).unlink()  # published, the folder holds the tokens and their meta.json only
        # mkdtemp makes the folder private; other users sharing the cache must be able to read it.
        os.chmod(tmp_dir, 0o755)
        _publish(tmp_dir, out_dir)
    except PublishedMeanwhile:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        progress(f"data: {out_dir} was published meanwhile by another job sharing the cache: packing stopped, "
                 "its tokens are read")
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


def remove_killed_writes(out_dir: Path, log: Callable[[str], None]) -> None:
    """Removes the temporary folders of `out_dir` whose writer is gone (killed while packing)."""
    for folder in remove_stale_temp_dirs(Path(out_dir).parent, _temp_prefix(Path(out_dir))):
        log(f"data: removed {folder}, left by a writer that was killed while packing")


def _temp_prefix(out_dir: Path) -> str:
    return f".{out_dir.name}.tmp"


class _Encoding(NamedTuple):
    num_threads: int  # the tokenizer's threads, in one process
    workers: int  # worker processes, each one tokenizer thread
    batch_chars: int


def _write_tokens(text_files: list[Path], tokenizer: Tokenizer, path: Path, report: Callable[[str], None],
                  fmt: RecordFormat, encoding: _Encoding, final: Path) -> dict:
    dtype = token_dtype(tokenizer.vocab_size)
    sizes = [stored_size(p) for p in text_files]
    progress = Progress(len(text_files), sum(sizes), report)
    count = RecordCount()
    parallel = encoding.workers > 1 and sum(sizes) > encoding.batch_chars  # one batch: no worker to wait for
    encoder = PoolEncoder(tokenizer, dtype, encoding.workers) if parallel else \
        InlineEncoder(tokenizer, dtype, encoding.num_threads)
    if parallel:
        report(f"data: tokenizing in {encoding.workers} worker processes")
    try:
        with open(path, "wb") as out:
            packer = _Packer(tokenizer, out, dtype, progress, encoder, encoding.batch_chars, final)
            for file_path, size in zip(text_files, sizes):
                packer.start_file(size)
                for document in iter_records(file_path, fmt, count):
                    packer.add(document, file_path)
                packer.end_file()
            packer.finish()
            if packer.num_documents == 0:
                raise ConfigError("data.source holds no text (empty files, or empty \"text\" fields only)"
                                  + count.skipped_note())
            out.flush()
            os.fsync(out.fileno())
    finally:
        encoder.close()
    progress.finish()
    return {
        "num_tokens": packer.num_tokens,
        "tokens_sha256": packer.digest.hexdigest(),
        "dtype": dtype.name,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer_path": str(tokenizer.path.resolve()),
        "tokenizer_sha256": tokenizer.sha256,
        "num_documents": packer.num_documents,
        "num_files": len(text_files),
        "sources_fingerprint": sources_fingerprint(text_files),
        **count.meta(),
    }


def _publish(tmp_dir: Path, out_dir: Path) -> None:
    """Renames the finished folder into place; if another writer won the race, keeps theirs."""
    if out_dir.exists() and not is_complete(out_dir):
        # Never one of ours (we only rename complete folders into place): e.g. an interrupted copy.
        shutil.rmtree(out_dir)
    try:
        os.replace(tmp_dir, out_dir)
    except OSError:
        if not is_complete(out_dir):
            raise
        shutil.rmtree(tmp_dir, ignore_errors=True)


_META_KEYS = ("num_tokens", "vocab_size", "dtype", "tokens_sha256", "tokenizer_sha256")


def _read_meta(folder: Path) -> dict:
    """meta.json, checked: a damaged one is one line naming the folder (deleting it rebuilds the cache)."""
    def damaged(reason: str) -> ConfigError:
        return ConfigError(f"packed tokens {folder}: {META_FILE} is {reason}; delete the folder and the next "
                           "start rebuilds it from data.source")

    try:
        meta = json.loads((folder / META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise damaged(f"unreadable ({type(e).__name__})") from e
    if not (isinstance(meta, dict) and all(k in meta for k in _META_KEYS)):
        raise damaged(f"missing some of {', '.join(_META_KEYS)}")
    return meta


class PackedTokens:
    """Read-only memory map of a packed folder, cut into overlapping (seq_len + 1)-token windows."""

    def __init__(self, out_dir: Path) -> None:
        self.path = Path(out_dir)
        if not is_complete(self.path):
            raise ConfigError(f"packed tokens {self.path} are missing or incomplete (no {META_FILE})")
        self.meta = _read_meta(self.path)
        self.num_tokens: int = self.meta["num_tokens"]
        self.vocab_size: int = self.meta["vocab_size"]
        dtype = np.dtype(self.meta["dtype"])
        expected_bytes = self.num_tokens * dtype.itemsize
        if (self.path / TOKENS_FILE).stat().st_size != expected_bytes:
            raise ConfigError(
                f"packed tokens {self.path} are corrupt: {TOKENS_FILE} is not {expected_bytes} bytes"
            )
        # np.memmap cannot map an empty file; an empty array behaves the same for every caller.
        self._tokens = (
            np.memmap(self.path / TOKENS_FILE, dtype=dtype, mode="r", shape=(self.num_tokens,))
            if self.num_tokens
            else np.zeros(0, dtype=dtype)
        )

    def fingerprint(self) -> dict[str, str]:
        """What a checkpoint records of these tokens (data_fingerprint)."""
        return data_fingerprint(self.path / TOKENS_FILE, self.num_tokens, self.meta["tokens_sha256"])

    def num_sequences(self, seq_len: int) -> int:
        """Windows of seq_len inputs + 1 shifted target; consecutive windows share one token."""
        if seq_len < 1:
            raise ConfigError(f"seq_len={seq_len} must be >= 1")
        count = (self.num_tokens - 1) // seq_len
        if count < 1:
            raise ConfigError(
                f"seq_len={seq_len} needs at least {seq_len + 1} tokens but the data has {self.num_tokens}"
            )
        return count

    def sequence(self, index: int, seq_len: int) -> np.ndarray:
        """Tokens [index*seq_len, index*seq_len + seq_len + 1) as int64: inputs [:-1], targets [1:]."""
        if not 0 <= index < self.num_sequences(seq_len):
            raise IndexError(f"sequence {index} out of range for seq_len={seq_len}")
        start = index * seq_len
        return np.array(self._tokens[start : start + seq_len + 1], dtype=np.int64)


DATA_BLOCKS, DATA_BLOCK_BYTES = 64, 64 << 10


def data_fingerprint(tokens_file: Path, num_tokens: int, tokens_sha256: str) -> dict[str, str]:
    """Content hashes of the packed tokens:
      data_sha256  of every byte, computed as the cache was written (recorded in its meta.json), so any
                   change of the data is seen without reading terabytes at every start
      data         the first and the last MiB, with the token count
      data_sample  64 blocks of 64 KiB spread evenly over the file (a file up to 4 MiB whole)
    Checkpoints older than data_sha256 (or data_sample) lack it and are checked by the sampled hashes."""
    size = tokens_file.stat().st_size
    last_start = max(0, size - DATA_BLOCK_BYTES)
    spread = sorted({last_start * i // (DATA_BLOCKS - 1) for i in range(DATA_BLOCKS)})
    ends = [(0, 1 << 20), (max(0, size - (1 << 20)), 1 << 20)]
    return {"data_sha256": tokens_sha256[:16], "data": _hash_blocks(tokens_file, num_tokens, ends),
            "data_sample": _hash_blocks(tokens_file, num_tokens, [(s, DATA_BLOCK_BYTES) for s in spread])}


def _hash_blocks(path: Path, num_tokens: int, blocks: list[tuple[int, int]]) -> str:
    digest = hashlib.sha256(str(num_tokens).encode())
    with open(path, "rb") as f:
        for start, length in blocks:
            f.seek(start)
            digest.update(f.read(length))
    return digest.hexdigest()[:16]
