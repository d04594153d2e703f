"""The attempt number every rank agrees on (parallel/attempt.py), with a real TCPStore and ranks as threads:
ranks that start before rank 0 publishes the new attempt, an earlier attempt that sealed or died before
sealing, and torchrun's per-node restart counts that disagree."""

import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from parallel.attempt import agreed_attempt, launch_name
from parallel.comm import CommTimeout


@pytest.fixture
def server():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    yield store


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=30))


def _attempt(server, world_size: int, restart_counts: list[int], rank0_delay_s: float = 0.0,
             timeout_s: float = 20.0, present: int | None = None) -> list:
    """agreed_attempt of the first `present` ranks (all by default), each in its own thread and store
    client, rank 0 `rank0_delay_s` after the others: their results, or what they raised."""
    results: list = [None] * (present or world_size)

    def rank(r: int) -> None:
        if r == 0:
            time.sleep(rank0_delay_s)
        try:
            results[r] = agreed_attempt(_client(server), r, world_size, restart_counts[r], timeout_s)
        except CommTimeout as e:
            results[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_every_rank_agrees_on_each_attempt_in_turn(server) -> None:
    assert _attempt(server, 3, [0, 0, 0]) == [(1, 0)] * 3
    # The restart: the other ranks read the sealed first attempt's number before rank 0 publishes the
    # second; their joins come after its seal, so they read again. Torchrun's counts differ per node.
    assert _attempt(server, 3, [0, 1, 0], rank0_delay_s=0.3) == [(2, 1)] * 3
    assert _attempt(server, 2, [0, 1], rank0_delay_s=0.3) == [(3, 2)] * 2  # a smaller world after a node left


def test_each_attempt_of_a_launch_reads_its_name_and_the_next_launch_gets_another(server) -> None:
    """A launch is its store: every attempt in it reads the name its first one set; a rerun of the same
    job id is a new torchrun with a new store. A first attempt whose rank 0 died before numbering it
    leaves the restart's number 1 with torchrun's count 1: still the launch's store. A restart on a store
    of its own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1) cannot name its launch."""
    first = _attempt(server, 2, [0, 0])[0]
    name = launch_name(_client(server), first[1], shared_store=True)
    second = _attempt(server, 2, [1, 1], rank0_delay_s=0.3)[0]
    assert second == (2, 1) and launch_name(_client(server), second[1], shared_store=True) == name
    assert len(name) == 32
    rerun = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    unnumbered = _attempt(rerun, 2, [1, 1])[0]
    assert unnumbered == (1, 1) and launch_name(_client(rerun), 1, shared_store=True) not in ("", name)
    fresh = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    assert launch_name(_client(fresh), _attempt(fresh, 2, [1, 0])[0][1], shared_store=False) == ""


def test_an_attempt_that_died_before_sealing_is_left_behind(server) -> None:
    store = _client(server)
    store.add("attempt/count", 1)
    store.set("attempt/newest", "1")
    store.add("attempt/1/joined", 1)  # one of its ranks joined, then the group died
    assert _attempt(server, 3, [1, 1, 0], rank0_delay_s=0.3) == [(2, 1)] * 3


def test_rank_0s_count_where_each_attempt_has_a_fresh_store(server) -> None:
    """torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the store is new, torchrun's count says restart."""
    assert _attempt(server, 2, [2, 0]) == [(1, 2)] * 2


def test_a_rank_that_never_starts_times_out_in_one_line(server) -> None:
    start = time.monotonic()
    results = _attempt(server, 3, [0, 0, 0], timeout_s=0.5, present=2)
    assert time.monotonic() - start < 5
    assert isinstance(results[0], CommTimeout) and "(waiting for 1 rank(s))" in str(results[0])
    assert isinstance(results[1], CommTimeout) and "(waiting for rank 0)" in str(results[1])
