"""checkpoint.async_save=true: the step loop stalls for the copy to host memory, not for the write.

A save stages (copies) the state, then DCP writes the copy from a background thread, its collectives on
a process group of their own, and the thread hashes this rank's files when they are written. The
checkpoint completes (manifest, rename, pruning) on the main thread at the first step boundary where
every rank's write is done: one tiny all-reduce per step while a save is in flight decides that, so
all ranks complete together. What the completion costs the main thread (those checks, any wait for the
write, the manifest, rename and pruning) is logged when it completes, the start's stall by the caller.
A save never overlaps the previous one (the next save, and the end of training, wait for it), and
until it completes it is an incomplete hidden folder that no resume loads: the bytes on disk, and what
a resume reads, are those of a synchronous save.
"""

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.distributed import ProcessGroup, ReduceOp

from parallel import comm
from trainer.checkpoint.files import (CheckpointError, ExtraFiles, complete_save, discard_save, own_files,
                                      prepare_save, prune_checkpoints, write_failure)


@dataclass
class _InFlight:
    step: int
    tmp: Path
    done: threading.Event = field(default_factory=threading.Event)
    files: dict | None = None  # this rank's written files, once done
    error: str | None = None
    stalled_s: float = 0.0  # main-thread time spent on its completion so far (polls, waits)


class AsyncCheckpointer:
    def __init__(self, root: Path, group: ProcessGroup, save_group: Callable[[], ProcessGroup], rank: int,
                 keep: int, extra_files: ExtraFiles, log: Callable[[str], None], device: torch.device):
        """`save_group()` gives the background writes' own process group (created on first use)."""
        self.root, self.group, self.save_group, self.rank, self.device = root, group, save_group, rank, device
        self.keep, self.extra_files, self.log = keep, extra_files, log
        self.in_flight: _InFlight | None = None

    def save(self, step: int, state: dict) -> None:
        """Start saving `state`: prepare its folder and copy it to host memory (after completing the
        previous save, if the caller has not)."""
        from trainer.checkpoint import dcp_io

        self.wait()
        save = _InFlight(step, prepare_save(self.root, step, self.group, self.rank))
        future = dcp_io.async_save_state(state, save.tmp, self.save_group())
        future.add_done_callback(lambda f: self._written(save, f))
        self.in_flight = save

    def _written(self, save: _InFlight, future) -> None:
        """In DCP's thread: hash this rank's files (or keep the error), then say so."""
        try:
            future.result()
            save.files = own_files(save.tmp, self.rank)
        except BaseException as e:  # DCP's CheckpointException is one; reported by every rank at completion
            save.error = write_failure(save.tmp, e)
        finally:
            save.done.set()  # else the next save, or the end of training, would wait forever

    def poll(self) -> None:
        """At a step boundary: complete the save in flight if every rank has written its part."""
        if self.in_flight is None:
            return
        start = time.perf_counter()
        # On the training device: the main group may be NCCL, which reduces device tensors only (the
        # checkpoint group is busy with the background write's own collectives).
        flag = torch.tensor([1.0 if self.in_flight.done.is_set() else 0.0], device=self.device)
        comm.all_reduce(flag, self.group, op=ReduceOp.MIN, label="async save done")
        written = flag.item() == 1.0
        self.in_flight.stalled_s += time.perf_counter() - start
        if written:
            self._complete()

    def wait(self) -> None:
        """Block until the save in flight is written everywhere, and complete it."""
        if self.in_flight is not None:
            start = time.perf_counter()
            self.in_flight.done.wait()
            self.in_flight.stalled_s += time.perf_counter() - start
            self._complete()

    def _complete(self) -> None:
        """Every rank: the manifest, the rename and pruning, on the main thread; logs what the save's
        completion cost the step loop, for a like-for-like comparison with a synchronous save's stall."""
        start = time.perf_counter()
        save, self.in_flight = self.in_flight, None
        errors = [e for e in comm.all_gather_object(save.error, self.group) if e]
        if errors:
            discard_save(save.tmp, self.group, self.rank)
            raise CheckpointError(f"the asynchronous save of step {save.step} failed: {errors[0]}")
        path = complete_save(save.tmp, save.files, self.group, self.rank, self.extra_files)
        if self.rank == 0:
            prune_checkpoints(self.root, self.keep)
        stalled = save.stalled_s + time.perf_counter() - start
        self.log(f"saved checkpoint {path} (written in the background; the step loop stalled {stalled:.3f} s "
                 f"completing it)")
