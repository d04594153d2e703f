"""Packing in worker processes writes the bytes one process writes; the progress line says where it is."""

import multiprocessing
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from tests.source_kinds import DOCUMENTS, train_small_tokenizer, write_every_kind
from trainer.data import progress as progress_module
from trainer.data.encode_pool import PoolEncoder, pack_batch
from trainer.data.progress import Progress
from trainer.data.shards import META_FILE, TOKENS_FILE, write_packed_tokens
from trainer.data.sources import list_source, sources_fingerprint
from trainer.data.tokenizer_spm import SentencePieceTokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> SentencePieceTokenizer:
    return train_small_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _pack(files: list[Path], tokenizer, out: Path, workers: int, logs: list[str]) -> dict[str, bytes]:
    write_packed_tokens(files, tokenizer, out, logs.append, num_threads=1, sources=sources_fingerprint(files),
                        workers=workers, batch_chars=2000)
    return {name: (out / name).read_bytes() for name in (TOKENS_FILE, META_FILE)}


def test_workers_write_the_bytes_one_process_writes(tmp_path, tokenizer) -> None:
    """Every kind at once (a tokenized Megatron pair among texts, whose batches are packed in this process
    while the others are in workers), in ~20 batches: order and content survive the round trips."""
    folder = write_every_kind(tmp_path / "mixed", DOCUMENTS * 12, tokenizer)
    files = list_source(str(folder)).files
    one_logs: list[str] = []
    pool_logs: list[str] = []
    one = _pack(files, tokenizer, tmp_path / "one", 1, one_logs)
    pooled = _pack(files, tokenizer, tmp_path / "pool", 2, pool_logs)
    assert pooled == one
    assert "data: tokenizing in 2 worker processes" in pool_logs
    assert not any("worker" in line for line in one_logs)
    for logs in (one_logs, pool_logs):  # the last line counts every file, those ended after the last batch too
        assert f"] 100% {len(files)}/{len(files)} files" in logs[-1], logs
    assert len(one[TOKENS_FILE]) > 20 * 2000 // 4  # well past one batch: the workers had several each


def test_the_progress_line_gives_files_megabytes_rate_and_eta(monkeypatch) -> None:
    monkeypatch.setattr(progress_module, "PROGRESS_MIN_INTERVAL_S", 0.0)
    lines: list[str] = []
    progress = Progress(total_files=4, total_bytes=8_000_000, report=lines.append)
    progress.update(files=1, position=2_000_000, text_bytes=2_000_000, tokens=500_000)
    progress.finish()
    assert re.fullmatch(r"data: tokenized \[#####\.{15}\] 25% 1/4 files, 2\.0/8\.0 MB, [\d.]+ MB/s, ETA \d+:\d\d, "
                        r"0\.50M tokens", lines[0]), lines
    assert re.fullmatch(r"data: tokenized \[#{20}\] 100% 1/4 files, 8\.0/8\.0 MB, [\d.]+ MB/s, in \d+:\d\d, "
                        r"0\.50M tokens", lines[1]), lines


def test_a_stop_signal_reaching_the_workers_leaves_the_pool_working(tokenizer) -> None:
    """Slurm's --signal warning reaches every process of the job step: the rank notes it (the trainer's
    handler), the workers go on encoding, and the batches are those one process packs."""
    noted: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, frame: noted.append(signum))
    encoder = PoolEncoder(tokenizer, np.uint32, 2)
    try:
        batches = [DOCUMENTS[i : i + 4] for i in range(0, 12, 4)]
        packed = [encoder.submit(batches[0])()]
        workers = multiprocessing.active_children()
        assert workers
        for pid in [os.getpid(), *(worker.pid for worker in workers)]:
            os.kill(pid, signal.SIGUSR1)
        time.sleep(0.5)  # a worker the signal killed would be gone by now
        packed += [encoder.submit(batch)() for batch in batches[1:]]
        assert all(worker.is_alive() for worker in workers)
    finally:
        encoder.close()
        signal.signal(signal.SIGUSR1, previous)
    assert noted == [signal.SIGUSR1]
    for batch, got in zip(batches, packed, strict=True):
        np.testing.assert_array_equal(got, pack_batch(tokenizer, batch, np.uint32, 1))
