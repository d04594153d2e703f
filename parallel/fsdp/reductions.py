"""Gradient reductions in flight, overlapped with the rest of the backward.

A reduction is a generator of stages (parallel/fsdp/grad_sync.py): each `next()` waits for the
collective the previous stage issued, does its local work and issues the next collective, until the
gradient lands in the shard. Pushing a new reduction first moves every earlier one on by one stage,
oldest first, then starts the new one; beyond `limit` in flight, the oldest is completed. Progress is
made only at these fixed program points (never "whichever finished first"), so every rank issues each
group's collectives in the same order, as gloo and NCCL require. `limit=0` is the synchronous path.
"""

from collections import deque
from collections.abc import Iterator


class ReductionQueue:
    def __init__(self, limit: int):
        self.limit = limit
        self._in_flight: deque[tuple[Iterator[None], int]] = deque()

    @property
    def bytes_in_flight(self) -> int:
        """Bytes of the unsharded gradients the reductions in flight keep alive, as each was pushed with."""
        return sum(nbytes for _, nbytes in self._in_flight)

    def push(self, reduction: Iterator[None], nbytes: int) -> None:
        for entry in list(self._in_flight):
            if not _advance(entry[0]):
                self._in_flight.remove(entry)
        if _advance(reduction):
            self._in_flight.append((reduction, nbytes))
        while len(self._in_flight) > self.limit:
            _complete(self._in_flight.popleft()[0])

    def drain(self) -> None:
        """Complete every reduction in flight, oldest first (the end of the step's backward)."""
        while self._in_flight:
            _complete(self._in_flight.popleft()[0])


def _advance(reduction: Iterator[None]) -> bool:
    """One stage on; False once the reduction is complete."""
    try:
        next(reduction)
        return True
    except StopIteration:
        return False


def _complete(reduction: Iterator[None]) -> None:
    for _ in reduction:
        pass
