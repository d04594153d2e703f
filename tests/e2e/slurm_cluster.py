"""A real one-node Slurm cluster for tests: Debian's slurmctld, slurmd and munge, installed if missing
(as root, with apt), configured in a temp folder (SLURM_CONF), started as child processes and stopped by
pid. Jobs see the repository as their submit directory."""

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "munged")


def install_reason() -> str | None:
    """None when the daemons are (or could be made) available; else why not."""
    if all(shutil.which(b) or Path(f"/usr/sbin/{b}").exists() for b in BINARIES):
        return None
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return "Slurm is not installed and cannot be (needs root and apt-get)"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            return f"apt-get could not install {' '.join(PACKAGES)}: {done.stderr[-300:]}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, folder: Path):
        self.folder = folder
        self.node = socket.gethostname().split(".")[0]
        self.conf = folder / "slurm.conf"
        self.processes: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    def write_conf(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.folder / sub).mkdir(parents=True, exist_ok=True)
        cpus = os.cpu_count() or 2
        self.conf.write_text(f"""\
ClusterName=test
SlurmctldHost={self.node}(127.0.0.1)
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={self.folder}/state
SlurmdSpoolDir={self.folder}/spool
SlurmctldPidFile={self.folder}/slurmctld.pid
SlurmdPidFile={self.folder}/slurmd.pid
SlurmctldLogFile={self.folder}/log/slurmctld.log
SlurmdLogFile={self.folder}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
MpiDefault=none
ReturnToService=2
KillWait=5
NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={self.node} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
""")

    def start(self) -> None:
        self.write_conf()
        munge_dir = Path("/run/munge")
        munge_dir.mkdir(parents=True, exist_ok=True)
        if not Path("/etc/munge/munge.key").exists():
            subprocess.run([_sbin("mungekey") if shutil.which("mungekey") else "/usr/sbin/mungekey", "--create"],
                           check=True, capture_output=True)
        if not (munge_dir / "munge.socket.2").exists():
            self._spawn([_sbin("munged"), "--foreground", "--force"])
            self._wait(lambda: (munge_dir / "munge.socket.2").exists(), "munged's socket")
        self._spawn([_sbin("slurmctld"), "-D", "-f", str(self.conf)])
        self._spawn([_sbin("slurmd"), "-D", "-f", str(self.conf)])
        self._wait(self._node_idle, "the Slurm node to be idle")

    def _spawn(self, argv: list[str]) -> None:
        log = (self.folder / "log" / f"{Path(argv[0]).name}.out").open("w")
        self.processes.append(subprocess.Popen(argv, env=self.env, stdout=log, stderr=subprocess.STDOUT))

    def _node_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], env=self.env, capture_output=True, text=True).stdout
        return out.strip() == "idle"

    def _wait(self, ready, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            for p in self.processes:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[0]} exited with {p.returncode} while waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out waiting for {what}")
            time.sleep(0.5)

    def run(self, *argv: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(list(argv), env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True, **kw)

    def job_state(self, job_id: str) -> str:
        return self.run("squeue", "-h", "-j", job_id, "-o", "%T").stdout.strip()

    def stop(self) -> None:
        for p in reversed(self.processes):
            p.terminate()
        for p in reversed(self.processes):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
