"""Exposed comm is counted whichever clock a backend blocks: gloo the host's, NCCL the compute
stream's (the host returns at once). A fake stream stands in for CUDA: its clock moves only when a
collective it waits for completes."""

import time

import pytest

from parallel import comm


class FakeStream:
    def __init__(self) -> None:
        self.now_ms = 0.0
        self.synchronized: set[int] = set()

    def event(self) -> "FakeEvent":
        return FakeEvent(self)


class FakeEvent:
    def __init__(self, stream: FakeStream) -> None:
        self.stream, self.at_ms = stream, None

    def record(self) -> None:
        self.at_ms = self.stream.now_ms

    def synchronize(self) -> None:
        self.stream.synchronized.add(id(self))

    def elapsed_time(self, end: "FakeEvent") -> float:
        # CUDA refuses elapsed_time before the end event has completed
        assert id(end) in self.stream.synchronized, "elapsed_time read before the end event completed"
        return end.at_ms - self.at_ms


class StreamBlockingWork:
    """An NCCL-like work: wait() makes the stream wait `ms` and returns to the host at once."""

    def __init__(self, stream: FakeStream, ms: float) -> None:
        self.stream, self.ms = stream, ms

    def wait(self) -> bool:
        self.stream.now_ms += self.ms
        return True


class HostBlockingWork:
    """A gloo-like work: wait() blocks the host."""

    def wait(self) -> bool:
        time.sleep(0.05)
        return True


@pytest.fixture
def stream():
    stream = FakeStream()
    comm.LEDGER.reset()
    comm.time_waits_on_stream(stream.event)
    yield stream
    comm.time_waits_on_stream(None)
    comm.LEDGER.reset()


def test_a_wait_that_blocks_the_stream_counts_the_stream_time(stream):
    comm.wait(StreamBlockingWork(stream, 200.0), "reduce_scatter", None, "layers.0")
    comm.wait(StreamBlockingWork(stream, 30.0), "all_gather", None, "layers.1")
    assert 0.23 <= comm.LEDGER.wait_s < 0.23 + 0.02  # both stream waits, plus at most the host's own


def test_a_wait_that_blocks_the_host_counts_the_host_time(stream):
    comm.wait(HostBlockingWork(), "all_reduce", None)
    assert 0.05 <= comm.LEDGER.wait_s < 0.5


def test_the_host_clock_alone_misses_a_stream_wait():
    """Why the stream events exist: without them an NCCL-like wait counts (almost) nothing."""
    stream = FakeStream()
    comm.LEDGER.reset()
    comm.wait(StreamBlockingWork(stream, 200.0), "reduce_scatter", None)
    assert comm.LEDGER.wait_s < 0.02
    comm.LEDGER.reset()


def test_issuing_an_asynchronous_collective_is_not_a_wait_and_reset_forgets(stream):
    with comm.traced("reduce_scatter", None, blocking=False):
        stream.now_ms += 100.0  # the stream runs compute meanwhile: not blocked on communication
    assert comm.LEDGER.wait_s < 0.02
    comm.wait(StreamBlockingWork(stream, 100.0), "reduce_scatter", None)
    assert comm.LEDGER.wait_s >= 0.1
    comm.LEDGER.reset()
    assert comm.LEDGER.wait_s == 0.0


def test_a_failed_wait_is_not_timed_and_the_clock_goes_on(stream):
    with pytest.raises(ValueError):
        with comm.traced("wait all_gather", None):
            stream.now_ms += 500.0
            raise ValueError("peer gone")
    comm.wait(StreamBlockingWork(stream, 10.0), "all_gather", None)
    assert 0.01 <= comm.LEDGER.wait_s < 0.03
