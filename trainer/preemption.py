"""stop_signal=USR1: a signal asks the job to checkpoint and exit cleanly (Slurm's warning before the
time limit or before preemption), so a requeued or resubmitted job resumes where it stopped.

Each rank notes the signal in a handler installed as the process starts (a signal during data
preparation, model build or checkpoint load, minutes at scale, stops the job after its first step
instead of being lost or killing the rank); after every step all ranks agree in one all-reduce (max) over
the world whether any of them got it (ranks receive a signal at slightly different times, and all must
stop after the same step). The stopped job saves a checkpoint of that step, writes
{dump_dir}/stopped.json (the step and the signal: what a batch script reads to requeue itself) and exits
0. A job removes an old stopped.json as soon as it owns the dump_dir, before anything can end it: a job
that ends early (nothing left to train) must not leave one behind for its batch script to requeue on.
"""

import json
import signal
from pathlib import Path

import torch
from torch.distributed import ProcessGroup

from parallel import comm

STOPPED_FILE = "stopped.json"


def forget_an_earlier_stop(dump_dir: Path) -> None:
    """Remove the stopped.json an earlier job left (rank 0, once the dump_dir is this job's)."""
    (dump_dir / STOPPED_FILE).unlink(missing_ok=True)


class StopRequest:
    """This rank's note of the stop signal, from the moment it is created."""

    def __init__(self, name: str | None):
        """`name`: a signal name without the SIG prefix (USR1), or None for no handler."""
        self.name, self.received = name, False
        if name is not None:
            signal.signal(signal.Signals[f"SIG{name}"], self._note)

    def _note(self, signum: int, frame: object) -> None:
        self.received = True


class StopOnSignal:
    def __init__(self, request: StopRequest, group: ProcessGroup | None, device: torch.device, dump_dir: Path):
        """With `request.name` None: never stops, and no all-reduce."""
        self.request, self.group, self.device = request, group, device
        self.marker = dump_dir / STOPPED_FILE

    def agreed(self) -> bool:
        """After a step, on every rank: did any rank get the signal? (One small all-reduce when enabled.)"""
        if self.request.name is None:
            return False
        flag = torch.tensor([float(self.request.received)], device=self.device)
        if comm.size_of(self.group) > 1:
            comm.all_reduce(flag, self.group, op=torch.distributed.ReduceOp.MAX, label="stop signal")
        return bool(flag.item())

    def record(self, step: int) -> None:
        self.marker.write_text(json.dumps({"step": step, "signal": f"SIG{self.request.name}"}))
