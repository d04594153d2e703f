"""Process groups of the sizes a layout needs, with no peers: torch's "fake" backend, whose collectives
return at once. Tracing a TP / CP block on the meta device runs its collectives for their shapes only.

A fake world exists only while a trace runs (`started`): the process's default group is free again after,
for whatever runs next in it. Groups are made on demand over its first ranks (TP ranks consecutive, CP
ranks strided by tp, as the mesh lays them out).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch.distributed as dist
from torch.distributed import ProcessGroup

from parallel.tensor_parallel import TPContext
from parallel.context_parallel import CPContext

WORLD = 1 << 12  # enough ranks for any tp x cp group a plan traces
_groups: dict[tuple[int, ...], ProcessGroup] = {}


@contextmanager
def started() -> Iterator[None]:
    """A fake default group for the duration (an enclosing one is reused)."""
    if dist.is_initialized():
        if "fake" not in dist.get_backend():
            raise RuntimeError("the planner traces with torch's fake process groups, but a real process group "
                               "is initialized in this process")
        yield
        return
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        yield
    finally:
        _groups.clear()
        dist.destroy_process_group()


def group(ranks: tuple[int, ...]) -> ProcessGroup:
    """A fake group over `ranks` (this process is rank 0 of every one), inside `started`."""
    if ranks not in _groups:
        _groups[ranks] = dist.new_group(list(ranks))
    return _groups[ranks]


def tp_context(tp: int, sequence_parallel: bool) -> TPContext:
    return TPContext(group(tuple(range(tp))) if tp > 1 else None, sequence_parallel)


def cp_context(tp: int, cp: int, comm_mode: str) -> CPContext:
    return CPContext(group(tuple(range(0, tp * cp, tp))) if cp > 1 else None, comm_mode)
