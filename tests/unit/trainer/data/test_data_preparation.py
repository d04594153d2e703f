"""How the ranks share one data preparation: the main rank builds the cache, the others wait for it or
for its error."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from parallel.errors import ConfigError
from tests import REPO
from trainer.data import prepare as data
from trainer.data.cache import CachePaths
from trainer.data.heartbeat import Heartbeat
from trainer.data.prepare import prepare_dataset
from trainer.data.temp_dirs import WRITER_FILE, make_writer_temp_dir
from trainer.data.tokenizer_spm import SentencePieceTokenizer

VOCAB = 320


def test_waiting_rank_gets_main_rank_result(corpus: Path, tmp_path: Path) -> None:
    waiter_logs: list[str] = []
    waiter = _start_waiter(str(corpus), tmp_path, waiter_logs)
    _, main_tokens = prepare_dataset(str(corpus), None, VOCAB, tmp_path, True, lambda line: None)
    waiter.join(timeout=30)
    assert waiter.result[1].path == main_tokens.path
    assert waiter_logs == []


def test_waiting_rank_fails_with_main_rank_error_or_timeout(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text("oops\n")
    waiter = _start_waiter(str(bad), tmp_path / "cache", [])
    with pytest.raises(ConfigError, match=r"bad\.jsonl:1 is not valid JSON"):
        prepare_dataset(str(bad), None, VOCAB, tmp_path / "cache", True, lambda line: None)
    waiter.join(timeout=30)
    assert isinstance(waiter.error, ConfigError)
    assert "failed on the main rank: " in str(waiter.error) and "bad.jsonl:1" in str(waiter.error)
    bad.write_text('{"text": "valid, but no main rank builds it"}\n')
    with pytest.raises(TimeoutError, match="did not finish"):
        prepare_dataset(str(bad), None, VOCAB, tmp_path / "cache", False, print, timeout_s=0.2)


def test_a_waiting_rank_waits_past_the_timeout_while_the_main_rank_beats(corpus: Path, tmp_path: Path) -> None:
    """A first preparation longer than data.prepare_timeout_s: the waiter gives up only after a timeout
    without a heartbeat, so a slow main rank is never abandoned (torchrun would then kill it)."""
    _, built = prepare_dataset(str(corpus), None, VOCAB, tmp_path / "elsewhere", True, lambda line: None)
    key = built.path.name.removeprefix("tokens-")
    cache = tmp_path / "cache"
    cache.mkdir()
    waiter = _start_waiter(str(corpus), cache, [], timeout_s=1)
    with Heartbeat(CachePaths(cache, key).progress, timeout_s=0.8) as heartbeat:  # a fake main rank
        assert heartbeat.interval_s == pytest.approx(0.2)
        time.sleep(3)
        _publish_copy(built.path.parent, cache, key)
    waiter.join(timeout=30)
    assert waiter.error is None and waiter.result[1].path == cache / built.path.name


def test_the_main_rank_beats_while_it_builds_and_clears_the_heartbeat_after(corpus: Path, tmp_path: Path,
                                                                             monkeypatch) -> None:
    build = data._build

    def slow_build(*args) -> None:
        time.sleep(2)  # longer than the waiter's timeout
        build(*args)

    monkeypatch.setattr(data, "_build", slow_build)
    waiter = _start_waiter(str(corpus), tmp_path, [], timeout_s=0.5)
    _, tokens = prepare_dataset(str(corpus), None, VOCAB, tmp_path, True, lambda line: None, timeout_s=0.5)
    waiter.join(timeout=30)
    assert waiter.error is None and waiter.result[1].path == tokens.path
    assert not list(tmp_path.glob("progress-*"))


def test_a_heartbeat_left_by_a_killed_main_rank_does_not_hold_the_waiter(corpus: Path, tmp_path: Path) -> None:
    _, built = prepare_dataset(str(corpus), None, VOCAB, tmp_path / "elsewhere", True, lambda line: None)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"progress-{built.path.name.removeprefix('tokens-')}").write_text("12345 7\n")
    with pytest.raises(TimeoutError, match=r"did not finish .*, nor show that it was still preparing it, within "
                                           r"data.prepare_timeout_s=0.3 s"):
        prepare_dataset(str(corpus), None, VOCAB, cache, False, print, timeout_s=0.3)


def test_packing_uses_the_cores_this_process_may_use_and_the_tokenizer_does_not_depend_on_them(
        corpus: Path, tmp_path: Path, monkeypatch) -> None:
    """sentencepiece records its thread count in the model: trained on the cores at hand, the same
    corpus would give another tokenizer (sha256) on another machine."""
    encode_threads: set[int] = set()
    encode_batch = SentencePieceTokenizer.encode_batch

    def spy(self, texts, num_threads):
        encode_threads.add(num_threads)
        return encode_batch(self, texts, num_threads)

    monkeypatch.setattr(SentencePieceTokenizer, "encode_batch", spy)
    models = []
    for cores in (5, 1):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, cores=cores: set(range(cores)), raising=False)
        tokenizer, _ = prepare_dataset(str(corpus), None, VOCAB, tmp_path / str(cores), True, lambda line: None)
        models.append(tokenizer.model_bytes)
    assert encode_threads == {5, 1} and models[0] == models[1]


def test_temp_folders_of_killed_writers_are_removed_before_building_and_live_ones_kept(corpus: Path,
                                                                                        tmp_path: Path) -> None:
    _, built = prepare_dataset(str(corpus), None, VOCAB, tmp_path, True, lambda line: None)
    shutil.rmtree(built.path)  # so the next start packs the tokens again
    prefix = f".{built.path.name}.tmp"
    killed = _temp_dir_of_a_killed_writer(tmp_path, prefix)
    live = make_writer_temp_dir(tmp_path, prefix)  # this process'
    elsewhere, long_quiet_elsewhere = (_temp_dir_written_on_another_host(tmp_path, prefix) for _ in range(2))
    two_days_ago = time.time() - 2 * 24 * 3600
    for path in (*long_quiet_elsewhere.iterdir(), long_quiet_elsewhere):
        os.utime(path, (two_days_ago, two_days_ago))
    unrecorded = tmp_path / f"{prefix}by_an_older_version"
    unrecorded.mkdir()
    lines: list[str] = []
    prepare_dataset(str(corpus), None, VOCAB, tmp_path, True, lines.append)
    assert not killed.exists() and not long_quiet_elsewhere.exists()
    assert live.exists() and elsewhere.exists() and unrecorded.exists()
    assert f"data: removed {killed}, left by a writer that was killed while packing" in lines
    assert not (built.path / WRITER_FILE).exists()  # the published folder is the tokens and meta.json only


def _temp_dir_of_a_killed_writer(parent: Path, prefix: str) -> Path:
    code = ("import os, signal, sys; from trainer.data.temp_dirs import make_writer_temp_dir; "
            "print(make_writer_temp_dir(sys.argv[1], sys.argv[2]), flush=True); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code, str(parent), prefix], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    folder = Path(proc.stdout.strip())
    (folder / "tokens.bin").write_bytes(b"\0" * 1024)
    return folder


def _temp_dir_written_on_another_host(parent: Path, prefix: str) -> Path:
    folder = make_writer_temp_dir(parent, prefix)
    (folder / WRITER_FILE).write_text(json.dumps({"host": "another-node", "pid": 1}))
    return folder


def _publish_copy(built: Path, cache: Path, key: str) -> None:
    """What a main rank publishes: the tokenizer, then the packed tokens renamed into place whole."""
    shutil.copytree(built / f"tokenizer-{key}", cache / f"tokenizer-{key}")
    shutil.copytree(built / f"tokens-{key}", cache / f".tokens-{key}.tmp")
    os.replace(cache / f".tokens-{key}.tmp", cache / f"tokens-{key}")


class _Waiter(threading.Thread):
    """A non-main rank, simulated by a thread sharing the cache folder."""

    def __init__(self, source: str, cache: Path, logs: list[str], timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.source, self.cache, self.logs, self.timeout_s = source, cache, logs, timeout_s
        self.result: tuple | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            self.result = prepare_dataset(self.source, None, VOCAB, self.cache, False, self.logs.append,
                                          timeout_s=self.timeout_s)
        except Exception as exc:  # inspected by the test
            self.error = exc


def _start_waiter(source: str, cache: Path, logs: list[str], timeout_s: float = 3600) -> _Waiter:
    waiter = _Waiter(source, cache, logs, timeout_s)
    waiter.start()
    time.sleep(0.1)  # let it start polling before the main rank begins
    return waiter
