"""Submit training through submitit (a Python entry for people who script sweeps), or run it here.

    python scripts/launch.py --nodes N --gpus-per-node G --partition P --time MINUTES [--local] [overrides]

Submits one task per node running the same torchrun command as scripts/slurm/train.sbatch, prints the
job id and the dump folder, and (with --wait) waits for the job. --local runs that command on this
machine without a scheduler (one node, --nproc-per-node ranks). On submitit's warning signal (SIGUSR2,
120 s before the time limit or on preemption) the trainer checkpoints and exits (stop_signal=USR2);
submitit then requeues the job, which resumes.
"""

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from functools import partial
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
WARNING_S = 120  # the warning signal's lead on the time limit
MAX_TIME_LIMITS = 10_000  # requeues after a time limit before submitit gives the job up

from scripts.launch_command import (check_stop_signal, check_values_here, count, dump_dir_of, free_port,  # noqa: E402
                                    positive_int, ranks_per_node, rendezvous_port, torchrun_args)


class TrainOnNode:
    """What each node's task runs: torchrun for this node, rendezvous on the job's first node.

    As a submitit checkpointable: Slurm sends submitit's warning signal to every process of the job;
    the workers (stop_signal set to it) save a checkpoint and exit, torchrun's agent ignores it, and
    submitit's handler on the first task calls `checkpoint`, which waits for torchrun to exit before
    submitit requeues the job (a requeue kills what still runs)."""

    def __init__(self, overrides: list[str], nproc_per_node: int, python: str, cwd: str | None = None,
                 max_restarts: int = 0):
        """`cwd`: where relative paths in the overrides point (the submitting directory)."""
        self.overrides, self.nproc_per_node, self.python = overrides, nproc_per_node, python
        self.cwd, self.max_restarts = cwd or os.getcwd(), max_restarts
        self.process: subprocess.Popen | None = None

    def __call__(self) -> int:
        import submitit

        env = submitit.JobEnvironment()
        stop_signal, default_dump = submitit_signal(), f"dump/submitit-{env.job_id}"
        if env.node == 0:  # before any node's torchrun starts: no worker can have stopped yet
            self.forget_an_earlier_stop()
        argv = torchrun_args(env.num_nodes, self.nproc_per_node, f"{env.hostnames[0]}:{rendezvous_port(env.job_id)}",
                             str(env.job_id), self.overrides, default_dump, self.python, stop_signal,
                             self.max_restarts, hosts_rendezvous=env.node == 0)
        # An ignored signal stays ignored across exec: the agent keeps it so; the workers set a handler.
        ignore = partial(signal.signal, signal.Signals[f"SIG{stop_signal}"], signal.SIG_IGN)
        self.process = subprocess.Popen(argv, cwd=self.cwd, preexec_fn=ignore)
        code = wait_for_exit(self.process.pid)
        if code != 0:
            raise RuntimeError(f"torchrun exited with {code}")
        return code

    def stop_marker(self) -> Path:
        """The file the trainer writes when it stops on the signal: {dump_dir}/stopped.json."""
        import submitit

        from trainer.outputs import STOPPED_FILE

        default_dump = f"dump/submitit-{submitit.JobEnvironment().job_id}"
        return Path(self.cwd) / dump_dir_of(self.overrides, default_dump) / STOPPED_FILE

    def forget_an_earlier_stop(self) -> None:
        """Only this run's stop counts, as in train.sbatch: a requeued job keeps its id, so the marker its
        previous run left (still there when torchrun's first attempt died before the trainer took the
        dump_dir over) would read as its own to the next attempt, which would stop at once, untrained."""
        self.stop_marker().unlink(missing_ok=True)

    def checkpoint(self) -> object:
        """Runs inside submitit's signal handler, on the main thread, which may be inside __call__'s
        wait: waits for the trainer to save and exit, then returns the resubmission; None (no requeue)
        when torchrun failed (the stop's save failed, and each requeue would train to the next time
        limit and fail again), or when the run finished without stopping (the signal came in its last
        step or after it): a requeue would start a finished run again, from step 0 without a checkpoint."""
        import submitit

        code = wait_for_exit(self.process.pid) if self.process is not None else None
        if code not in (0, None):
            print(f"torchrun exited with {code} after the stop signal: not requeued", file=sys.stderr, flush=True)
            return None
        if not self.stop_marker().exists():
            print("the run finished without stopping on the signal: not requeued", file=sys.stderr, flush=True)
            return None
        return submitit.helpers.DelayedSubmission(
            TrainOnNode(self.overrides, self.nproc_per_node, self.python, self.cwd, self.max_restarts))


def submitit_signal() -> str:
    """The warning signal submitit has Slurm send (USR2 unless its environment changes it)."""
    import submitit

    return submitit.JobEnvironment.USR_SIG


def wait_for_exit(pid: int) -> int | None:
    """The exit code of child `pid`, from plain waitpid polls. Popen.wait holds a lock that a signal
    handler waiting on the same child would block on forever; this holds none. None if the other
    waiter (the handler, or the code it interrupted) reaped the child first."""
    while True:
        try:
            done, status = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return None
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.2)


def slurm_executor(logs: Path, nodes: int, gpus_per_node: int, timeout_min: int, partition: str | None,
                   cpus_per_task: int | None = None, warning_s: int = WARNING_S) -> object:
    """submitit's Slurm executor for one task per node, with the warning signal `warning_s` before the
    limit (the stop finishes its step, then saves a checkpoint: a large model on a slow file system
    needs more). `cpus_per_task`: the cores of the node's one task, which runs all of its ranks (None:
    the cluster's default, often one core)."""
    import submitit

    # submitit fails a job after 3 time limits by default; a long run meets its limit at every requeue.
    executor = submitit.AutoExecutor(folder=logs, cluster="slurm", slurm_max_num_timeout=MAX_TIME_LIMITS)
    executor.update_parameters(
        nodes=nodes, tasks_per_node=1, gpus_per_node=gpus_per_node or None, timeout_min=timeout_min,
        slurm_partition=partition, slurm_signal_delay_s=warning_s, name="llm-train",
    )
    if cpus_per_task is not None:  # srun does not inherit sbatch's count (Slurm 22.05 on): passed on, as train.sbatch
        executor.update_parameters(cpus_per_task=cpus_per_task, slurm_srun_args=[f"--cpus-per-task={cpus_per_task}"])
    return executor


def refuse_scheduler_flags(parser: argparse.ArgumentParser, opts: argparse.Namespace) -> None:
    """Flags only a scheduler reads, set to anything but what --local does (one node, here, waited for):
    each would be dropped without a word."""
    given = [flag for flag, value in (("--nodes", opts.nodes != 1), ("--partition", opts.partition is not None),
                                      ("--cpus-per-task", opts.cpus_per_task is not None),
                                      ("--time", opts.time != parser.get_default("time")),
                                      ("--warning-s", opts.warning_s != WARNING_S),
                                      ("--logs", opts.logs != parser.get_default("logs"))) if value]
    if given:
        parser.error(f"{given[0]} does not combine with --local (it runs one node here, without a scheduler)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=positive_int, default=1)
    parser.add_argument("--gpus-per-node", type=int, choices=range(0, 65), metavar="0..64", default=0)
    parser.add_argument("--nproc-per-node", type=positive_int, help="ranks per node (default: GPUs per node, or 1)")
    parser.add_argument("--partition")
    parser.add_argument("--cpus-per-task", type=positive_int, help="cores of each node's task, which runs all of "
                        "its ranks (default: the cluster's, often one)")
    parser.add_argument("--time", type=positive_int, default=60, help="minutes")
    parser.add_argument("--warning-s", type=positive_int, default=WARNING_S,
                        help="seconds before the time limit that the stop signal comes: the stop's step and checkpoint "
                        f"must fit (default {WARNING_S})")
    parser.add_argument("--local", action="store_true", help="run here, without a scheduler")
    parser.add_argument("--wait", action="store_true", help="wait for the job and fail if it fails")
    parser.add_argument("--logs", default="dump/submitit_logs")
    parser.add_argument("--max-restarts", type=count, default=0, help="torchrun restarts when a worker dies")
    parser.add_argument("overrides", nargs="*")
    opts = parser.parse_args()
    nproc = ranks_per_node(opts.nproc_per_node, opts.gpus_per_node)
    if opts.local:
        refuse_scheduler_flags(parser, opts)
    else:
        check_stop_signal(opts.overrides, submitit_signal())
    check_values_here(opts.overrides, (1 if opts.local else opts.nodes) * nproc)
    if opts.local:
        argv = torchrun_args(1, nproc, f"localhost:{free_port()}", f"local-{uuid.uuid4().hex[:8]}", opts.overrides,
                             "dump/local", sys.executable, max_restarts=opts.max_restarts, hosts_rendezvous=True)
        print(f"running locally; dump folder {dump_dir_of(opts.overrides, 'dump/local')}", flush=True)
        sys.exit(subprocess.run(argv).returncode)
    executor = slurm_executor(REPO / opts.logs, opts.nodes, opts.gpus_per_node, opts.time, opts.partition,
                              opts.cpus_per_task, opts.warning_s)
    try:
        job = executor.submit(TrainOnNode(opts.overrides, nproc, sys.executable, max_restarts=opts.max_restarts))
    except Exception as e:  # submitit's FailedJobError carries sbatch's own message, often several lines
        print(f"error: submitting the job: {' '.join(str(e).split())}", file=sys.stderr)
        sys.exit(1)
    print(f"submitted job {job.job_id}; dump folder {dump_dir_of(opts.overrides, f'dump/submitit-{job.job_id}')}",
          flush=True)
    if opts.wait:
        job.result()
        print(f"job {job.job_id} finished", flush=True)


if __name__ == "__main__":
    main()
