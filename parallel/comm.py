"""The one gateway to torch.distributed collectives, with a per-step ledger.

Every collective of the framework goes through a function here, so the ledger sees all of them:
per op and per named group, how many calls and how many bytes. The trainer resets it at the start of
each step and writes its snapshot to metrics.jsonl as `comm`; tests assert exact counts from it.
Bytes count the full collective buffer: the tensor for all_reduce, the gathered output for all_gather,
the unreduced input for reduce_scatter. (Collectives the framework does not use yet are added here
when a feature needs them, so none escapes the ledger.)

Each call also opens a profiler range named "op group [label]" (label: the FSDP unit, the pipeline
stage), so a trace shows which collective ran where; outside profiling the range costs microseconds.

The ledger also sums the time this rank spent blocked on communication ("exposed comm"): synchronous
collectives for their whole duration, asynchronous ones while `wait` waits for them. gloo blocks the
host, NCCL the compute stream: `time_waits_on_stream` makes the clock see the latter (see wait_clock.py).

On gloo two collectives are issued as others that need no private full-size buffer (see
`_gather_by_broadcasts`, `_reduce_scatter_in_place`); the ledger still counts the collective asked for.
"""

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp, Work
from torch.profiler import record_function

from parallel.wait_clock import StreamEvent, WaitClock

_group_names: dict[ProcessGroup, str] = {}

# torch 2.13 renamed the tensor collectives; older releases only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def register_groups(names: dict[ProcessGroup, str]) -> None:
    """Name process groups for the ledger; the mesh in use registers its dimensions (later wins)."""
    _group_names.update(names)


def forget_groups() -> None:
    """Drop the ledger's references to process groups, so destroy_process_group really frees them
    (a group kept alive until interpreter teardown can take its gloo threads down with an abort)."""
    _group_names.clear()


def world() -> ProcessGroup:
    """Every rank of the job (the collectives take no None for it; see _record)."""
    return dist.group.WORLD


def size_of(group: ProcessGroup | None) -> int:
    """A group's size; no group means this process alone."""
    return 1 if group is None else group.size()


def rank_in(group: ProcessGroup | None) -> int:
    return 0 if group is None else group.rank()


def group_name(group: ProcessGroup | None) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    return _group_names.get(group, f"group{dist.get_process_group_ranks(group)}")


class CommTimeout(RuntimeError):
    """A collective that did not complete within the process groups' timeout."""


class CommLedger:
    """Counts and bytes per (op, group) since the last reset, and where the rank is (for errors)."""

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        self.wait_clock = WaitClock()  # time blocked on communication since the last reset
        self.step: int | None = None
        self.where: dict[str, str] = {}  # e.g. {"stage": "pipeline r1 B c0 m2", "unit": "backward of layers.3"}
        self.timeout_s: float | None = None

    def record(self, op: str, group: ProcessGroup | None, nbytes: int) -> None:
        entry = self._entries[(op, group_name(group))]
        entry[0] += 1
        entry[1] += nbytes

    def reset(self, step: int | None = None) -> None:
        self._entries.clear()
        self.wait_clock.reset()
        self.step = step
        self.where.clear()

    @property
    def wait_s(self) -> float:
        """Seconds blocked on communication since the last reset (waits for the stream's timed waits)."""
        return self.wait_clock.total_s()

    def describe(self, op: str, group: ProcessGroup | None, label: str) -> str:
        """The op (of what: its label, e.g. the FSDP unit), group, step and where the rank was, for a
        one-line error."""
        what = op.removeprefix("wait ") + (f" of {label}" if label else "")
        places = [self.where[k] for k in ("stage", "unit") if k in self.where] or list(self.where.values())
        places.insert(0, f"step {self.step}" if self.step is not None else "before the first step")
        limit = f" within comm_timeout_s={self.timeout_s:g}" if self.timeout_s is not None else ""
        return f"{what} on group {group_name(group)} did not complete{limit} ({', '.join(places)})"

    def by_op(self) -> dict[str, dict[str, int]]:
        """{op: {count, bytes}} summed over groups: the `comm` field of metrics.jsonl."""
        out: dict[str, dict[str, int]] = {}
        for (op, _), (count, nbytes) in sorted(self._entries.items()):
            slot = out.setdefault(op, {"count": 0, "bytes": 0})
            slot["count"] += count
            slot["bytes"] += nbytes
        return out

    def by_group(self) -> dict[str, dict[str, dict[str, int]]]:
        """{group: {op: {count, bytes}}}."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (op, name), (count, nbytes) in sorted(self._entries.items()):
            out.setdefault(name, {})[op] = {"count": count, "bytes": nbytes}
        return out

    def count(self, op: str, group: str | None = None) -> int:
        return sum(c for (o, g), (c, _) in self._entries.items() if o == op and group in (None, g))


LEDGER = CommLedger()


def time_waits_on_stream(make_event: Callable[[], StreamEvent] | None) -> None:
    """Count the time the compute stream (not only the host) is blocked on collectives, as NCCL blocks
    it: `make_event` makes a timing event of the device's streams; None goes back to the host clock."""
    LEDGER.wait_clock.use_stream_events(make_event)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _record(op: str, group: ProcessGroup, nbytes: int) -> None:
    """Count a collective in the ledger. `group` must be given: in this framework None means "no group"
    (a parallel dimension of size 1, see size_of), while torch.distributed would take it for every rank."""
    if group is None:
        raise ValueError(f"{op} called with group=None, which here means no group; pass the group "
                         "(dist.group.WORLD for every rank)")
    LEDGER.record(op, group, nbytes)


def set_where(kind: str, text: str) -> None:
    """Where this rank is (kind: "phase", "stage", "unit"), named by a collective that times out."""
    LEDGER.where[kind] = text


def set_phase(text: str) -> None:
    """A new phase of the step (e.g. "optimizer step"): the places of the previous one no longer apply."""
    LEDGER.where.clear()
    LEDGER.where["phase"] = text


def _timed_out(e: RuntimeError) -> bool:
    """The collective's own timeout, or (gloo) a peer's timeout in the same collective, which closes the
    connection: "Application timeout caused pair closure"."""
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


@contextmanager
def traced(op: str, group: ProcessGroup | None, label: str = "", blocking: bool = True) -> Iterator[None]:
    """The profiler range of a collective (or of waiting for one); a blocking one's time is exposed comm.
    A timeout becomes one CommTimeout line naming the op, the group and where the rank is."""
    try:
        with record_function(f"{op} {group_name(group)}" + (f" {label}" if label else "")):
            if blocking:
                with LEDGER.wait_clock.interval():
                    yield
            else:
                yield
    except RuntimeError as e:
        if _timed_out(e) and not isinstance(e, CommTimeout):
            raise CommTimeout(LEDGER.describe(op, group, label)) from e
        raise


class ComposedWork:
    """A collective issued as several: done when each of `works` is, after which `finish` (e.g. copying
    this rank's chunk out) runs once."""

    def __init__(self, works: list[Work], finish: Callable[[], object] | None = None) -> None:
        self._works, self._finish = works, finish

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        if self._finish is not None:
            self._finish()
            self._finish = None
        return True


Pending = Work | ComposedWork


def _on_gloo(group: ProcessGroup, tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu" and dist.get_backend(group) == "gloo"


def _check_split(op: str, whole: torch.Tensor, part: torch.Tensor, group: ProcessGroup) -> None:
    """The sizes torch's own collective insists on, checked alike on every rank before anything is
    sent: a rank that failed alone later (no piece of its own) would leave the others waiting."""
    if whole.numel() != part.numel() * group.size() or part.numel() == 0 or whole.dtype != part.dtype:
        raise ValueError(f"{op} on group {group_name(group)}: {tuple(whole.shape)} {whole.dtype} is not "
                         f"{group.size()} x {tuple(part.shape)} {part.dtype}")


def _gather_by_broadcasts(output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup) -> ComposedWork:
    """Gloo gathers into a private buffer the size of `output` and copies it out when done; held across
    the compute an asynchronous gather overlaps (FSDP's prefetch), that is one more unsharded unit.
    Each rank's broadcast of its shard lands straight in `output` instead, the same bytes per rank."""
    _check_split("all_gather", output, shard, group)
    chunks = output.view(-1).split(shard.numel())
    chunks[group.rank()].copy_(shard.reshape(-1))
    return ComposedWork([dist.broadcast(chunk, group=group, group_src=i, async_op=True)
                         for i, chunk in enumerate(chunks)])


def _reduce_scatter_in_place(output: torch.Tensor, full: torch.Tensor, group: ProcessGroup,
                             op: ReduceOp) -> ComposedWork:
    """Gloo reduce-scatters by all-reducing a private copy of the whole input and keeping this rank's
    chunk. When the caller is done with `full`, all-reducing it in place gives the same sums without
    the copy, which would otherwise live beside it while the reduction is in flight."""
    _check_split("reduce_scatter", full, output, group)
    work = dist.all_reduce(full, op=op, group=group, async_op=True)
    mine = full.view(-1).split(output.numel())[group.rank()]
    return ComposedWork([work], lambda: output.view(-1).copy_(mine))


def wait(work: Pending, op: str, group: ProcessGroup | None, label: str = "") -> None:
    """Wait for an asynchronous collective; the time blocked counts as exposed comm."""
    with traced(f"wait {op}", group, label):
        work.wait()


def all_reduce(
    tensor: torch.Tensor, group: ProcessGroup, op: ReduceOp = ReduceOp.SUM, async_op: bool = False,
    label: str = "",
) -> Work | None:
    _record("all_reduce", group, _nbytes(tensor))
    with traced("all_reduce", group, label, blocking=not async_op):
        return dist.all_reduce(tensor, op=op, group=group, async_op=async_op)


def all_gather_into_tensor(
    output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool = False, label: str = ""
) -> Pending | None:
    _record("all_gather", group, _nbytes(output))
    with traced("all_gather", group, label, blocking=not async_op):
        if async_op and _on_gloo(group, output):
            return _gather_by_broadcasts(output, shard, group)
        return _all_gather_single(output, shard, group=group, async_op=async_op)


def reduce_scatter_tensor(
    output: torch.Tensor,
    full: torch.Tensor,
    group: ProcessGroup,
    op: ReduceOp = ReduceOp.SUM,
    async_op: bool = False,
    label: str = "",
    consume_input: bool = False,
) -> Pending | None:
    """`consume_input`: the caller never reads `full` again, so it may be reduced in place (its contents
    are then undefined)."""
    _record("reduce_scatter", group, _nbytes(full))
    with traced("reduce_scatter", group, label, blocking=not async_op):
        if consume_input and _on_gloo(group, full):
            work = _reduce_scatter_in_place(output, full, group, op)
            if async_op:
                return work
            work.wait()
            return None
        return _reduce_scatter_single(output, full, op=op, group=group, async_op=async_op)


def batch_isend_irecv(
    ops: list[tuple[bool, torch.Tensor, int]], group: ProcessGroup, label: str = ""
) -> list[Work]:
    """Post point-to-point sends (True) and receives (False) to ranks of `group` as one batch; returns
    one work per op, in order. The ledger counts each as a "send" or "recv" of its tensor's bytes."""
    p2p = []
    for is_send, tensor, peer in ops:
        _record("send" if is_send else "recv", group, _nbytes(tensor))
        p2p.append(dist.P2POp(dist.isend if is_send else dist.irecv, tensor, group=group, group_peer=peer))
    with traced("send_recv", group, label, blocking=False):
        works = dist.batch_isend_irecv(p2p)
    return _work_per_op(works, len(ops))


def _work_per_op(works: list[Work], num_ops: int) -> list[Work]:
    """gloo returns a work per operation, NCCL one work for its coalesced batch, done when all of it is.
    Callers pair works with operations: paired with a batch's first op only, a receive after a send
    (even pipeline ranks list sends first) would never be waited on, and CUDA would read its buffer
    before NCCL wrote it."""
    if len(works) == num_ops:
        return works
    if len(works) == 1:
        return works * num_ops
    raise RuntimeError(f"batch_isend_irecv returned {len(works)} works for {num_ops} operations")


def barrier(group: ProcessGroup) -> None:
    _record("barrier", group, 0)
    with traced("barrier", group):
        dist.barrier(group=group)


def all_gather_object(obj: object, group: ProcessGroup) -> list[object]:
    """For small control messages (checksums, error strings); never for tensors."""
    _record("all_gather_object", group, 0)
    out: list[object] = [None] * dist.get_world_size(group)
    with traced("all_gather_object", group):
        dist.all_gather_object(out, obj, group=group)
    return out
