"""Start the process and own the dump_dir, then hand the job to a Trainer: the body of train.py.

    run(cfg, launch, dims)   device, determinism, seeds, process groups; then, every rank on the same
                             config: the mesh, the dump_dir's lock, an earlier stop honoured; then
                             Trainer(...).resume() / .train() / .close(); process groups end last
"""

import ctypes
import dataclasses
import os
import signal
import traceback
from functools import partial
from pathlib import Path

import torch

from parallel import comm
from parallel.errors import ConfigError
from parallel.launch_env import LaunchEnv
from parallel.mesh import ParallelDims, ParallelMesh, init_process_group, shutdown_process_groups
from trainer.config.rules import start_notes
from trainer.config.schema import TrainConfig, flat_values
from trainer.determinism import enable_deterministic, seed_everything
from trainer.outputs import STOPPED_FILE, output_folders
from trainer.resilience.dump_dir_lock import own_dump_dir
from trainer.resilience.preemption import StopRequest, take_over_stop_marker
from trainer.trainer import Trainer, log0

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def select_device(launch: LaunchEnv) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(launch.local_rank)
        # NCCL blocks the compute stream, not the host: exposed comm is timed with stream events.
        comm.time_waits_on_stream(partial(torch.cuda.Event, enable_timing=True))
        return torch.device("cuda", launch.local_rank)
    return torch.device("cpu")


def exit_with_launcher() -> None:
    """A worker must not train on after its torchrun agent is killed (kill -9 leaves it orphaned, still
    writing into the dump_dir): Linux sends it SIGKILL when its parent dies. Elsewhere a no-op."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the agent died before prctl took effect
        os._exit(1)


def run(cfg: TrainConfig, launch: LaunchEnv, dims: ParallelDims) -> None:
    """Train with a validated config (trainer.config.rules.validate gave `dims`)."""
    stop_request = StopRequest(cfg.stop_signal)  # first: a stop signal during start-up is kept
    for note in start_notes(cfg, dims):
        log0(launch.rank, note)
    if launch.torchrun:
        exit_with_launcher()
    device = select_device(launch)
    if cfg.enable_deterministic_training:
        enable_deterministic(device.type)
    seed_everything(cfg.seed)
    # Agreed by every rank: torchrun's per-node count differs between nodes after a failure on one of them.
    restarts, name = init_process_group(launch, device, cfg.comm_timeout_s)
    launch = dataclasses.replace(launch, restart_count=restarts, launch_name=name)
    try:
        _train(cfg, launch, dims, device, stop_request)
    except BaseException as e:
        raise _without_frames(e)
    finally:
        shutdown_process_groups()


def _without_frames(e: BaseException) -> BaseException:
    """The exception with its traceback kept as text (a note) instead of frames. The frames of a failed
    step hold the trainer and, through it, the process groups, which must be freed before they are
    destroyed: a gloo group still alive at interpreter exit can abort the process."""
    e.add_note("".join(traceback.format_exception(e)).rstrip())
    link: BaseException | None = e
    while link is not None:
        link.__traceback__ = None
        link = link.__cause__ or link.__context__
    return e


def _train(cfg: TrainConfig, launch: LaunchEnv, dims: ParallelDims, device: torch.device,
           stop_request: StopRequest) -> None:
    _same_config_on_every_rank(cfg)  # first: ranks of other parallel sizes would build other groups and stall
    mesh = ParallelMesh(dims, device.type, cfg.comm_timeout_s)
    # Rank 0's name for the job on every rank (a static launch's is its agent's, so per node).
    launch = dataclasses.replace(launch, run_id=comm.all_gather_object(launch.run_id, comm.world())[0])
    dump_dir = Path(cfg.dump_dir)
    lock = own_dump_dir(dump_dir, output_folders(cfg), launch.rank, launch.run_id, launch.restart_count,
                        comm.world())
    try:
        stopped = take_over_stop_marker(dump_dir, launch.launch_name, launch.run_id) if lock is not None else None
        stopped = comm.all_gather_object(stopped, comm.world())[0]
        if stopped is not None:
            log0(launch.rank, f"an earlier attempt of this job stopped after step {stopped} on its stop signal and "
                 f"torchrun restarted it when a worker failed: stopping again ({STOPPED_FILE} kept for the requeue)")
            return
        trainer = Trainer(cfg, launch, mesh, device, stop_request, lock)
        trainer.train(trainer.resume())
        trainer.close()
    finally:
        if lock is not None:
            lock.release()


def _same_config_on_every_rank(cfg: TrainConfig) -> None:
    """Every rank resolved the same config: a node launched with other overrides, or a value resolved
    per process (`dump_dir=run_${now:%H%M%S}`), would train other models or write into other folders."""
    configs = comm.all_gather_object(flat_values(cfg), comm.world())
    for rank, other in enumerate(configs):
        differing = [key for key, value in configs[0].items() if other.get(key) != value]
        if differing:
            key = differing[0]
            raise ConfigError(
                f"{key}: rank {rank} resolved {other.get(key)!r}, rank 0 {configs[0][key]!r}; every rank must "
                f"run the same overrides, and a value that resolves per process (such as ${{now:...}}) cannot be used")
