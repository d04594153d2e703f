"""The launchers on a real one-node Slurm cluster (slurmctld, slurmd, munge; installed if missing): a
batch-script job trains (the loss falls) and, told to stop with SIGUSR1, checkpoints, requeues itself and
resumes bitwise; a submitit job does the same on submitit's SIGUSR2; a hydra sweep with
hydra/launcher=torchrun_slurm runs each point as its own job. Daemons are stopped by pid."""

import subprocess
import sys
import time

import pytest

from tests.e2e.launch import DATA_CACHE, ENV, REPO, losses, metrics, train_ok
from tests.e2e.slurm_cluster import SlurmCluster, install_reason

pytestmark = pytest.mark.slurm
TINY = ("model=tiny", "seq_len=64", "batch_size=2", "log_all_steps=true", f"data.cache_dir={DATA_CACHE}")
JOB_ENV = {"NPROC_PER_NODE": "2", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = install_reason()
    if reason is not None:
        pytest.skip(reason)
    slurm = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        slurm.start()
        yield slurm
    finally:
        slurm.stop()


def _sbatch(cluster: SlurmCluster, out, overrides: tuple[str, ...]) -> str:
    """Submit the batch script; returns the job id."""
    done = cluster.run("sbatch", "--parsable", f"--output={out}", "--time=5", "scripts/slurm/train.sbatch",
                       *overrides, cwd=REPO, env=JOB_ENV, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(";")[0]


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, float]:
    return losses(train_ok(2, tmp_path_factory.mktemp("straight"), *TINY, "steps=60"))


def _stop_mid_run_and_finish_after_requeue(cluster: SlurmCluster, job: str, dump, out, signal_name: str) -> None:
    """Signal the job after step 5, then wait until it has stopped, been requeued and run to step 60."""
    deadline = time.monotonic() + 120
    while not (dump / "metrics.jsonl").exists() or len(metrics(dump)) < 5:
        assert time.monotonic() < deadline, out.read_text()[-3000:] if out.exists() else "no job output"
        time.sleep(0.2)
    cluster.run("scancel", f"--signal={signal_name}", job)
    released = False

    def finished() -> bool:
        return cluster.job_state(job) == "" and metrics(dump)[-1]["step"] == 60

    while not finished():  # stopped, requeued, run again to the end
        assert time.monotonic() < deadline + 60, out.read_text()[-3000:] if out.exists() else "no job output"
        if not released and cluster.run("squeue", "-h", "-j", job, "-o", "%T %r").stdout.strip() == "PENDING BeginTime":
            # Slurm holds a requeued job back for two minutes before it may start again: start it in a few
            # seconds (not at once: the old run's revoked job credential must be older than the new one).
            released = cluster.run("scontrol", "update", f"JobId={job}", "StartTime=now+3").returncode == 0
        time.sleep(0.5)
    assert not (dump / "stopped.json").exists()  # the requeued job finished and removed it
    checkpoints = sorted(p.name for p in (dump / "checkpoints").iterdir())
    assert checkpoints and all(name.startswith("step_") for name in checkpoints), checkpoints


def test_stop_signal_checkpoints_requeues_and_resumes_bitwise(cluster, tmp_path, straight):
    dump, out = tmp_path / "run", tmp_path / "job.out"
    job = _sbatch(cluster, out, (*TINY, "steps=60", f"dump_dir={dump}"))
    _stop_mid_run_and_finish_after_requeue(cluster, job, dump, out, "USR1")
    assert "requeueing job" in out.read_text(), out.read_text()[-3000:]
    resumed = losses(metrics(dump))
    assert sorted(resumed) == list(range(1, 61)) and resumed[60] < resumed[1] - 0.3
    assert resumed == straight


def test_submitit_job_stops_on_its_signal_requeues_and_resumes_bitwise(cluster, tmp_path, straight):
    """submitit asks Slurm for SIGUSR2 before the time limit and requeues from its own handler: the
    trainer stops on that signal, torchrun's agent outlives it, the handler waits for the save."""
    dump, logs = tmp_path / "run", tmp_path / "logs"
    launcher = subprocess.Popen(
        [sys.executable, "scripts/launch.py", "--nodes", "1", "--nproc-per-node", "2", "--time", "5", "--wait",
         "--logs", str(logs), *TINY, "steps=60", f"dump_dir={dump}"],
        cwd=REPO, env={**ENV, **cluster.env, **JOB_ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        submitted = launcher.stdout.readline()
        assert submitted.startswith("submitted job ") and f"dump folder {dump}" in submitted, submitted
        job = submitted.split()[2].rstrip(";")
        _stop_mid_run_and_finish_after_requeue(cluster, job, dump, next(iter(logs.glob("*_log.err")), logs), "USR2")
        stdout, stderr = launcher.communicate(timeout=120)
    finally:
        launcher.kill()
    assert launcher.returncode == 0, stdout + stderr[-3000:]
    log = "".join(p.read_text() for p in sorted(logs.glob("*_log.*")))  # submitit's info lines go to .out
    assert "Requeued job" in log and "stopping after step" in log, log[-3000:]
    resumed = losses(metrics(dump))
    assert sorted(resumed) == list(range(1, 61))
    assert resumed == straight


def test_hydra_sweep_on_slurm_runs_one_job_per_point(cluster, tmp_path, straight):
    sweep, logs = tmp_path / "sweep", tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, "train.py", "-m", "hydra/launcher=torchrun_slurm", "hydra.launcher.nproc_per_node=2",
         "hydra.launcher.slurm.timeout_min=5", f"hydra.launcher.slurm.logs={logs}", *TINY, "steps=2",
         f"dump_dir={sweep}", "seed=0,1"],
        cwd=REPO, env={**ENV, **cluster.env, **JOB_ENV}, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.count("Slurm job") == 2, proc.stdout
    first, second = losses(metrics(sweep / "0")), losses(metrics(sweep / "1"))
    assert sorted(first) == sorted(second) == [1, 2]
    assert first[1] == straight[1] and second[1] != first[1]  # step 1 depends only on the seed's weights and data
