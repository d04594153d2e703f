"""Batches of documents in, packed `bos ids eos` tokens out, in the order given: in this process, or in
worker processes (data.prepare_workers) that each load the tokenizer from its file.

The bytes are the same either way: a document's ids depend on the document alone, and the results are
written in submission order. Workers are spawned, not forked: the trainer's process holds threads (torch,
the process group) that a fork would copy in whatever state they were in.
"""

import multiprocessing
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from parallel.errors import ConfigError
from trainer.config.ranges import STOP_SIGNALS
from trainer.data.tokenizer import Tokenizer, load_tokenizer

Document = str | np.ndarray  # text, or token ids already checked and without bos/eos (a Megatron document)


def pack_batch(tokenizer: Tokenizer, documents: list[Document], dtype: np.dtype, num_threads: int) -> np.ndarray:
    """`bos ids eos` for each document, back to back; texts are encoded in one batch call."""
    texts = [doc for doc in documents if isinstance(doc, str)]
    encoded = iter(tokenizer.encode_batch(texts, num_threads) if texts else [])
    bos, eos = tokenizer.bos_id, tokenizer.eos_id
    flat: list[int] = []
    for doc in documents:
        flat.append(bos)
        flat.extend(next(encoded) if isinstance(doc, str) else doc.tolist())
        flat.append(eos)
    return np.asarray(flat, dtype=dtype)


class InlineEncoder:
    """Encodes each batch as it is submitted, with the tokenizer's own threads."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype, num_threads: int) -> None:
        self._tokenizer, self._dtype, self._num_threads = tokenizer, dtype, num_threads
        self.workers = 0

    def submit(self, documents: list[Document]) -> Callable[[], np.ndarray]:
        packed = pack_batch(self._tokenizer, documents, self._dtype, self._num_threads)
        return lambda: packed

    def close(self) -> None:
        pass


_worker_tokenizer: Tokenizer | None = None


def _pack_in_worker(path: Path, sha256: str, documents: list[Document], dtype: np.dtype) -> np.ndarray:
    """Loaded at a worker's first batch rather than in a pool initializer: an error here (the file gone or
    replaced) comes back as itself, where a failed initializer only breaks the pool."""
    global _worker_tokenizer
    if _worker_tokenizer is None:
        _worker_tokenizer = load_tokenizer(path)
        if _worker_tokenizer.sha256 != sha256:
            raise ConfigError(f"data.tokenizer {path} changed while the data was being prepared; start again")
    return pack_batch(_worker_tokenizer, documents, dtype, 1)


# The signals stop_signal may name. Slurm's warning (--signal) reaches every process of the job step:
# the rank notes it and stops after a step, but a worker, whose handler spawning reset to the default,
# would die of it and break the pool, losing the stop. Workers start with them blocked (a child inherits
# the mask of the thread that starts it) and ignore them before unblocking.
STOP_SIGNALS_FOR_THE_RANK = tuple(signal.Signals[f"SIG{name}"] for name in STOP_SIGNALS)


def _ignore_stop_signals() -> None:
    """A worker's initializer."""
    for sig in STOP_SIGNALS_FOR_THE_RANK:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS_FOR_THE_RANK)


@contextmanager
def _stop_signals_blocked() -> Iterator[None]:
    """This thread's stop signals held (not lost: one arriving meanwhile is delivered on leaving)."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS_FOR_THE_RANK)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


class PoolEncoder:
    """Encodes batches in `workers` spawned processes, one tokenizer thread each; results come back in
    submission order (the caller bounds how many are in flight)."""

    def __init__(self, tokenizer: Tokenizer, dtype: np.dtype, workers: int) -> None:
        self._tokenizer, self._dtype, self.workers = tokenizer, dtype, workers
        self._pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"),
                                         initializer=_ignore_stop_signals)

    def submit(self, documents: list[Document]) -> Callable[[], np.ndarray]:
        if not any(isinstance(doc, str) for doc in documents):  # already tokenized: nothing to farm out
            packed = pack_batch(self._tokenizer, documents, self._dtype, 1)
            return lambda: packed
        with _stop_signals_blocked():  # a submit may start a worker
            future = self._pool.submit(_pack_in_worker, self._tokenizer.path, self._tokenizer.sha256, documents,
                                       self._dtype)
        return future.result

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
