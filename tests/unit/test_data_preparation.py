"""How the ranks share one data preparation: the main rank builds the cache, the others wait for it or
for its error."""

import threading
import time
from pathlib import Path

import pytest

from parallel.errors import ConfigError
from trainer.data import prepare_dataset

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


class _Waiter(threading.Thread):
    """A non-main rank, simulated by a thread sharing the cache folder."""

    def __init__(self, source: str, cache: Path, logs: list[str]) -> None:
        super().__init__(daemon=True)
        self.source, self.cache, self.logs = source, cache, logs
        self.result: tuple | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            self.result = prepare_dataset(self.source, None, VOCAB, self.cache, False, self.logs.append)
        except Exception as exc:  # inspected by the test
            self.error = exc


def _start_waiter(source: str, cache: Path, logs: list[str]) -> _Waiter:
    waiter = _Waiter(source, cache, logs)
    waiter.start()
    time.sleep(0.1)  # let it start polling before the main rank begins
    return waiter
