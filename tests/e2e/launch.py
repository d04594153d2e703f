"""Run train.py as users do (torchrun, hydra overrides) and read what it wrote."""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

from tests import REPO

DATA_CACHE = REPO / ".cache" / "data"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(nproc: int, dump_dir: Path, *overrides: str, fault: str | None = None, max_restarts: int = 0,
            standalone: bool = True) -> list[str]:
    """train.py on `nproc` CPU ranks under torchrun, or as a plain process for nproc=0. `fault`: run it
    through tests/e2e/faulty_train.py with that fault (POINT:STEP:RANK). standalone=False: a static
    launch on a free port, whose rendezvous id is torchrun's default "none"."""
    args = [f"dump_dir={dump_dir}", f"data.cache_dir={DATA_CACHE}", *overrides]
    script = [str(REPO / "train.py")] if fault is None else [str(REPO / "tests" / "e2e" / "faulty_train.py"), fault]
    if nproc == 0:
        return [sys.executable, *script, *args]
    restarts = [f"--max-restarts={max_restarts}"] if max_restarts else []
    rendezvous = ["--standalone"] if standalone else [f"--master_port={free_port()}"]
    return [sys.executable, "-m", "torch.distributed.run", *rendezvous, f"--nproc_per_node={nproc}", *restarts,
            *script, *args]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train(nproc: int, dump_dir: Path, *overrides: str, cwd: Path | None = None, timeout: float = 300,
          fault: str | None = None, max_restarts: int = 0, standalone: bool = True):
    """Launch train.py (with `fault`: through faulty_train.py) and wait; returns the CompletedProcess."""
    return subprocess.run(command(nproc, dump_dir, *overrides, fault=fault, max_restarts=max_restarts,
                                  standalone=standalone),
                          cwd=cwd or REPO, env=ENV, capture_output=True, text=True, timeout=timeout)


def start(nproc: int, dump_dir: Path, *overrides: str) -> subprocess.Popen:
    """Launch train.py without waiting (its output goes to files in dump_dir's parent)."""
    dump_dir.parent.mkdir(parents=True, exist_ok=True)
    out = (dump_dir.parent / f"{dump_dir.name}.out").open("w")
    err = (dump_dir.parent / f"{dump_dir.name}.err").open("w")
    return subprocess.Popen(command(nproc, dump_dir, *overrides), cwd=REPO, env=ENV, stdout=out, stderr=err, text=True)


def train_ok(nproc: int, dump_dir: Path, *overrides: str, **kw) -> list[dict]:
    proc = train(nproc, dump_dir, *overrides, **kw)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return metrics(dump_dir)


def died_before_saving(dump_dir: Path, step: int) -> None:
    """Make a finished job look like one that died after logging `step` but before its checkpoint: the
    last step is always saved, so remove that save (and check it was written)."""
    path = dump_dir / "checkpoints" / f"step_{step}"
    assert (path / "manifest.json").is_file(), f"the last step's checkpoint {path} was not written"
    shutil.rmtree(path)


def metrics(dump_dir: Path) -> list[dict]:
    path = dump_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records}


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def assert_one_error(proc, *fragments: str) -> None:
    """Non-zero exit and exactly one `error:` line holding every fragment, and no rank's own traceback
    (torchrun's failure report, from the line where it names the failed worker on, may hold some)."""
    assert proc.returncode != 0
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-3000:]
    before_torchrun_report = proc.stderr.split("failed (exitcode")[0]
    assert "Traceback (most recent call last)" not in before_torchrun_report, proc.stderr[-5000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
