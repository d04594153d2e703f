"""The clock of exposed communication: how long a rank's compute was blocked on collectives.

gloo blocks the host for a collective's whole duration, so the host clock measures it. NCCL blocks the
compute stream instead and the host returns at once: there the time is the gap between two events
recorded on the compute stream around the call, which the stream passes only once the collective is
done (nothing else is queued between them). With stream events on, each blocked interval counts the
larger of the two clocks, so neither kind of wait is missed and none is counted twice.
"""

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Protocol


class StreamEvent(Protocol):
    """What is used of torch.cuda.Event(enable_timing=True)."""

    def record(self) -> None: ...
    def synchronize(self) -> None: ...
    def elapsed_time(self, end: "StreamEvent") -> float: ...  # milliseconds


class WaitClock:
    """Blocked time since the last reset; stream intervals are resolved when the total is read."""

    def __init__(self) -> None:
        self._make_event: Callable[[], StreamEvent] | None = None
        self.reset()

    def use_stream_events(self, make_event: Callable[[], StreamEvent] | None) -> None:
        """Also time intervals on the current stream (CUDA: `torch.cuda.Event(enable_timing=True)`)."""
        self._make_event = make_event

    def reset(self) -> None:
        self._host_s = 0.0
        self._stream_intervals: list[tuple[float, StreamEvent, StreamEvent]] = []

    @contextmanager
    def interval(self) -> Iterator[None]:
        """Time the enclosed blocking call (the body's own errors propagate, untimed)."""
        events = None
        if self._make_event is not None:
            events = self._make_event(), self._make_event()
            events[0].record()
        start = time.perf_counter()
        yield
        host_s = time.perf_counter() - start
        if events is None:
            self._host_s += host_s
            return
        events[1].record()
        self._stream_intervals.append((host_s, *events))

    def total_s(self) -> float:
        """Seconds blocked; waits for the stream to pass the last interval it has to time."""
        total = self._host_s
        for host_s, start, end in self._stream_intervals:
            end.synchronize()
            total += max(host_s, start.elapsed_time(end) / 1e3)
        return total
