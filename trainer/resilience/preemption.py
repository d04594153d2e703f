"""stop_signal=USR1: a signal asks the job to checkpoint and exit cleanly (Slurm's warning before the
time limit or before preemption), so a requeued or resubmitted job resumes where it stopped.

Each rank notes the signal in a handler installed as the process starts (a signal during data
preparation, model build or checkpoint load, minutes at scale, stops the job after its first step
instead of being lost or killing the rank); after every step all ranks agree in one all-reduce (max) over
the world whether any of them got it (ranks receive a signal at slightly different times, and all must
stop after the same step). The stopped job writes {dump_dir}/stopped.json (the step, the signal and the
job: what a batch script reads to requeue itself), then saves a checkpoint of that step (a worker that
dies in that save leaves the marker for torchrun's restart) and exits 0. A job removes an earlier job's
stopped.json as soon as it owns the dump_dir, before anything can end it: a job that ends early (nothing
left to train) must not leave one behind for its batch script to requeue on. A torchrun restart of the same job (a worker failed after the stop) finds its own
stopped.json and stops at once: training on would end at the time limit, unrequeued. A requeued job
keeps its id: the launchers that requeue (train.sbatch, scripts/launch.py) remove the marker before
each run starts torchrun, so a restart never takes the previous run's stop for its own.
"""

import json
import signal
from pathlib import Path

import torch
from torch.distributed import ProcessGroup

from parallel import comm
from parallel.errors import ConfigError
from parallel.launch_env import LaunchEnv
from trainer.outputs import STOPPED_FILE
from trainer.resilience import early_signals


def check_stop_signal_reaches_workers(stop_signal: str | None, launch: LaunchEnv) -> None:
    """A stop_signal torchrun's agent handles itself never stops the trainer cleanly: the agent
    terminates the workers on it (SIGHUP by default), mid-step, without a checkpoint."""
    if stop_signal is not None and stop_signal in launch.agent_signals:
        raise ConfigError(f"stop_signal={stop_signal}: torchrun's agent takes SIG{stop_signal} itself and terminates "
                          "the workers on it (TORCHELASTIC_SIGNALS_TO_HANDLE): use USR1 or USR2")


def take_over_stop_marker(dump_dir: Path, launch_name: str, job: str) -> int | None:
    """Rank 0, once the dump_dir is this job's: the step an earlier attempt of this same torchrun launch
    stopped after (torchrun restarted the group), which leaves the marker in place; otherwise the marker
    an earlier launch left is removed, and None. The launch's name, not the job's id: a rerun with the
    same --rdzv_id whose first attempt died before getting here would take the last run's stop for its
    own and exit untrained. Where a restart cannot name its launch (launch_name ""), the job's id."""
    marker = dump_dir / STOPPED_FILE
    try:
        stopped = json.loads(marker.read_text())
        if stopped["launch"] == launch_name if launch_name else stopped["job"] == job:
            return int(stopped["step"])
    except (OSError, ValueError, TypeError, KeyError):
        pass  # none, or not this launch's: an earlier launch's marker, removed below
    marker.unlink(missing_ok=True)
    return None


class StopRequest:
    """This rank's note of the stop signal, from the moment it is created (or, where a launcher had the
    signal ignored, from the moment train.py started: trainer.resilience.early_signals)."""

    def __init__(self, name: str | None):
        """`name`: a signal name without the SIG prefix (USR1), or None for no handler."""
        self.name, self.received = name, False
        stop_signal = signal.Signals[f"SIG{name}"] if name is not None else None
        if stop_signal is not None:
            signal.signal(stop_signal, self._note)
        # A signal during imports counts too; one the new handler noted meanwhile is kept (Slurm warns once).
        self.received = early_signals.release(stop_signal) or self.received

    def _note(self, signum: int, frame: object) -> None:
        self.received = True


class StopOnSignal:
    def __init__(self, request: StopRequest, group: ProcessGroup | None, device: torch.device, dump_dir: Path,
                 job: str, launch_name: str):
        """With `request.name` None: never stops, and no all-reduce. `job`: torchrun's run id;
        `launch_name`: this torchrun launch's (parallel/attempt.py)."""
        self.request, self.group, self.device, self.job, self.launch_name = request, group, device, job, launch_name
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
        self.marker.write_text(json.dumps({"step": step, "signal": f"SIG{self.request.name}", "job": self.job,
                                           "launch": self.launch_name}))
