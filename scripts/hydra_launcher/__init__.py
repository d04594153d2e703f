"""Hydra launchers that run every point of a sweep (`train.py -m ...`) as its own torchrun job.

    python train.py -m hydra/launcher=torchrun hydra.launcher.nproc_per_node=4 seed=1,2,3
    python train.py -m hydra/launcher=torchrun_slurm hydra.launcher.nproc_per_node=8 \
        hydra.launcher.slurm.nodes=2 hydra.launcher.slurm.gpus_per_node=8 hydra.launcher.slurm.partition=gpu \
        optim.lr=1e-4,3e-4

Hydra's basic launcher would run each point in-process on one rank, and a sweep under torchrun would
run every point on every worker through one rendezvous. These build, per point, the same torchrun
command as every other launcher (`scripts/launch_command.py`) with `dump_dir={dump_dir}/{job number}`
(the point's own dump_dir as the config resolves it, made absolute against the directory hydra was
started in, where the points run too, so relative paths in overrides mean the same), and run it here
one point after another (`torchrun`) or submit it as a Slurm job through submitit
(`torchrun_slurm`, the same task as `scripts/launch.py`: checkpoint on the warning signal, requeue;
a point's `stop_signal` other than submitit's is refused before any point is submitted).
A point that fails marks the sweep failed (hydra then exits non-zero); the other points still run.

Hydra takes launchers only from the `hydra_plugins` package: pyproject maps this folder there. The
trainer's own launch helpers are imported when a sweep launches, from the checkout that runs train.py,
so that hydra's plugin scan in any other hydra program never depends on them.
"""

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Sequence

from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra.plugins.launcher import Launcher
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig


class TorchrunLauncher(Launcher):
    """One torchrun job per sweep point: here, one after another, or on Slurm (`slurm` set)."""

    def __init__(self, nproc_per_node: int | None, slurm: DictConfig | None = None) -> None:
        from scripts.launch_command import ranks_per_node

        nproc_per_node = ranks_per_node(nproc_per_node, slurm.gpus_per_node if slurm is not None else None)
        if int(nproc_per_node) < 1:
            raise ValueError(f"hydra.launcher.nproc_per_node={nproc_per_node} must be at least 1")
        self.nproc_per_node, self.slurm = int(nproc_per_node), slurm
        self.config: DictConfig | None = None
        self.hydra_context: HydraContext | None = None

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config, self.hydra_context = config, hydra_context

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from scripts.launch_command import hydra_quoted, override_key

        Path(str(self.config.hydra.sweep.dir)).expanduser().resolve().mkdir(parents=True, exist_ok=True)
        points = []
        for job, overrides in enumerate(job_overrides, initial_job_idx):
            overrides = list(filter_overrides(overrides))
            # As a sweep run in the hydra process: {the point's dump_dir}/{job}, relative to where hydra runs.
            point = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
            dump_dir = Path(str(point.dump_dir)).expanduser().resolve() / str(job)
            kept = [o for o in overrides if "=" not in o or override_key(o) != "dump_dir"]
            points.append((job, [*kept, f"dump_dir={hydra_quoted(str(dump_dir))}"]))
        if self.slurm is None:
            return [_job_return(overrides, self._run_here(overrides, job)) for job, overrides in points]
        return self._run_on_slurm(points)

    def _run_here(self, overrides: list[str], job: int) -> Exception | None:
        from scripts.launch_command import free_port, torchrun_args

        # This torchrun hosts its store: one that took the port meanwhile is an error, not a store to join.
        argv = torchrun_args(1, self.nproc_per_node, f"localhost:{free_port()}", f"sweep-{uuid.uuid4().hex[:8]}-{job}",
                             overrides, python=sys.executable, hosts_rendezvous=True)
        print(f"sweep point {job}: {' '.join(overrides)}", flush=True)
        code = subprocess.run(argv).returncode  # in hydra's directory: relative paths mean what they do there
        return None if code == 0 else RuntimeError(f"sweep point {job} ({' '.join(overrides)}): torchrun exited {code}")

    def _run_on_slurm(self, points: list[tuple[int, list[str]]]) -> list[JobReturn]:
        from scripts.launch import REPO, TrainOnNode, slurm_executor, submitit_signal
        from scripts.launch_command import check_stop_signal

        for _, overrides in points:  # before anything is submitted, as scripts/launch.py
            check_stop_signal(overrides, submitit_signal())
        s = self.slurm
        executor = slurm_executor(REPO / str(s.logs), s.nodes, s.gpus_per_node, s.timeout_min, s.partition)
        jobs = [(overrides, executor.submit(TrainOnNode(overrides, self.nproc_per_node, sys.executable)))
                for _, overrides in points]
        for (job, overrides), (_, submitted) in zip(points, jobs):
            print(f"sweep point {job}: Slurm job {submitted.job_id}: {' '.join(overrides)}", flush=True)
        returns = []
        for overrides, submitted in jobs:
            try:
                submitted.result()
                returns.append(_job_return(overrides, None))
            except Exception as e:  # noqa: BLE001 (a failed point fails the sweep, after the others finished)
                returns.append(_job_return(overrides, RuntimeError(f"Slurm job {submitted.job_id}: {e}")))
        return returns


def _job_return(overrides: list[str], failure: Exception | None) -> JobReturn:
    ret = JobReturn(overrides=overrides, status=JobStatus.COMPLETED if failure is None else JobStatus.FAILED)
    ret.return_value = failure if failure is not None else 0
    return ret
