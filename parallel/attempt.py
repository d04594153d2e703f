"""Which attempt of the job this worker group is, agreed by every rank through torchrun's store.

torchrun's agents (one per node) share one store for the whole job, and a group that torchrun restarts
(--max-restarts) finds in it what the dead group wrote: the addresses its ranks listened on. The new
group must connect through keys of its own. Each agent's TORCHELASTIC_RESTART_COUNT cannot name them:
it counts that node's failures only, so after a worker failed on one node the nodes disagree (a node
whose workers were stopped for another's failure restarts them as a membership change, uncounted),
and ranks would wait for peers under another name, or read the dead group's addresses.

The store also names the launch: its first attempt's rank 0 sets a random name that every later attempt
finds, and the next torchrun launch of the same job id (a new store) gets another.

So rank 0 numbers the attempt (an atomic counter in the store) and the other ranks learn the number:
each joins under the newest number it reads, rank 0 seals the attempt once all have joined, recording
how many, and a rank whose join came after a seal (it read an earlier attempt's number, before rank 0
published the new one) knows the number is stale and reads again.
"""

import time
import uuid

import torch.distributed as dist

from parallel.comm import CommTimeout

POLL_S = 0.02
_NEWEST = "attempt/newest"
_LAUNCH = "attempt/launch"


def agreed_attempt(store: dist.Store, rank: int, world_size: int, restart_count: int, timeout_s: float) -> tuple[int, int]:
    """(attempt number, restarts before it), the same on every rank. The number is unique within the
    store's life; the restarts are rank 0's count: the attempts this store saw before, or its agent's
    TORCHELASTIC_RESTART_COUNT (`restart_count`) where each attempt gets a fresh store."""
    deadline = time.monotonic() + timeout_s
    if rank == 0:
        return _number_and_seal(store, world_size, restart_count, deadline)
    while True:
        number = _read_newest(store, deadline)
        joined = store.add(_key(number, "joined"), 1)
        sealed = _wait_for_seal(store, number, deadline)
        if sealed is not None and joined <= sealed[0]:
            return number, sealed[1]
        _wait_a_moment(deadline, "rank 0")  # an earlier attempt's number: rank 0 has yet to publish this one's


def launch_name(store: dist.Store, restarts: int, shared_store: bool) -> str:
    """This torchrun launch's name, the same in each of its attempts; read once agreed_attempt returned
    (`restarts`: its second value). "" for a restart where each attempt gets a store of its own
    (`shared_store` false: torchrun's TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1): the launch cannot be named there."""
    if restarts > 0 and not shared_store:
        return ""
    return store.get(_LAUNCH).decode()


def _number_and_seal(store: dist.Store, world_size: int, restart_count: int, deadline: float) -> tuple[int, int]:
    number = store.add("attempt/count", 1)
    store.compare_set(_LAUNCH, "", uuid.uuid4().hex)  # set once, before the number is published
    restarts = max(number - 1, restart_count)
    store.set(_NEWEST, str(number))
    while (missing := world_size - 1 - store.add(_key(number, "joined"), 0)) > 0:
        _wait_a_moment(deadline, f"{missing} rank(s)")
    store.set(_key(number, "sealed"), f"{world_size - 1} {restarts}")
    return number, restarts


def _read_newest(store: dist.Store, deadline: float) -> int:
    while not store.check([_NEWEST]):
        _wait_a_moment(deadline, "rank 0")
    return int(store.get(_NEWEST))


def _wait_for_seal(store: dist.Store, number: int, deadline: float) -> tuple[int, int] | None:
    """(ranks joined, restarts) once rank 0 sealed attempt `number`; None once a newer attempt is
    published (`number` belonged to a group that died before sealing)."""
    key = _key(number, "sealed")
    while not store.check([key]):
        if int(store.get(_NEWEST)) != number:
            return None
        _wait_a_moment(deadline, "rank 0")
    joined, restarts = store.get(key).decode().split()
    return int(joined), int(restarts)


def _wait_a_moment(deadline: float, waiting_for: str) -> None:
    if time.monotonic() > deadline:
        raise CommTimeout(f"the ranks of this attempt did not all start within comm_timeout_s (waiting for "
                          f"{waiting_for}): a worker failed to start, or torchrun's nodes disagree on the world size")
    time.sleep(POLL_S)


def _key(number: int, what: str) -> str:
    return f"attempt/{number}/{what}"

