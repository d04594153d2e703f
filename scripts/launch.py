"""Submit training through submitit (a Python entry for people who script sweeps), or run it here.

    python scripts/launch.py --nodes N --gpus-per-node G --partition P --time MINUTES [--local] [overrides]

Submits one task per node running the same torchrun command as scripts/slurm/train.sbatch, prints the
job id and the dump folder, and (with --wait) waits for the job. --local runs that command on this
machine without a scheduler (one node, --nproc-per-node ranks). On Slurm's warning signal the trainer
checkpoints and exits (stop_signal=USR1); the job is then requeued and resumes.
"""

import argparse
import subprocess
import sys
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.launch_command import dump_dir_of, torchrun_args  # noqa: E402


class TrainOnNode:
    """What each node's task runs: torchrun for this node, rendezvous on the job's first node. As a
    submitit checkpointable, a warning signal lets the trainer finish its checkpoint, then requeues."""

    def __init__(self, overrides: list[str], nproc_per_node: int, python: str):
        self.overrides, self.nproc_per_node, self.python = overrides, nproc_per_node, python
        self.process: subprocess.Popen | None = None

    def __call__(self) -> int:
        import submitit

        env = submitit.JobEnvironment()
        argv = torchrun_args(env.num_nodes, self.nproc_per_node, f"{env.hostnames[0]}:{29500 + int(env.job_id) % 1000}",
                             str(env.job_id), self.overrides, f"dump/submitit-{env.job_id}", self.python)
        self.process = subprocess.Popen(argv, cwd=REPO)
        code = self.process.wait()
        if code:
            raise RuntimeError(f"torchrun exited with {code}")
        return code

    def checkpoint(self):
        """The warning signal reached the trainer too: let it save and exit, then requeue."""
        import submitit

        if self.process is not None:
            self.process.wait()
        return submitit.helpers.DelayedSubmission(TrainOnNode(self.overrides, self.nproc_per_node, self.python))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=0)
    parser.add_argument("--nproc-per-node", type=int, help="ranks per node (default: GPUs per node, or 1)")
    parser.add_argument("--partition")
    parser.add_argument("--time", type=int, default=60, help="minutes")
    parser.add_argument("--local", action="store_true", help="run here, without a scheduler")
    parser.add_argument("--wait", action="store_true", help="wait for the job and fail if it fails")
    parser.add_argument("--logs", default="dump/submitit_logs")
    parser.add_argument("overrides", nargs="*")
    opts = parser.parse_args()
    nproc = opts.nproc_per_node or max(opts.gpus_per_node, 1)
    if opts.local:
        argv = torchrun_args(1, nproc, "localhost:29500", f"local-{uuid.uuid4().hex[:8]}", opts.overrides, "dump/local", sys.executable)
        print(f"running locally; dump folder {dump_dir_of(opts.overrides, 'dump/local')}", flush=True)
        sys.exit(subprocess.run(argv, cwd=REPO).returncode)
    import submitit

    executor = submitit.AutoExecutor(folder=REPO / opts.logs, cluster="slurm")
    executor.update_parameters(
        nodes=opts.nodes, tasks_per_node=1, gpus_per_node=opts.gpus_per_node or None, timeout_min=opts.time,
        slurm_partition=opts.partition, slurm_signal_delay_s=120, name="llm-train",
    )
    job = executor.submit(TrainOnNode(opts.overrides, nproc, sys.executable))
    print(f"submitted job {job.job_id}; dump folder {dump_dir_of(opts.overrides, f'dump/submitit-{job.job_id}')}",
          flush=True)
    if opts.wait:
        job.result()
        print(f"job {job.job_id} finished", flush=True)


if __name__ == "__main__":
    main()
