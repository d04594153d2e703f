"""Run train.py as users do (torchrun, hydra overrides) and read what it wrote."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DATA_CACHE = REPO / ".cache" / "data"


def train(nproc: int, dump_dir: Path, *overrides: str, cwd: Path | None = None, timeout: float = 300):
    """Launch train.py on `nproc` CPU ranks (a plain process for nproc=0); returns the CompletedProcess."""
    args = [f"dump_dir={dump_dir}", f"data.cache_dir={DATA_CACHE}", *overrides]
    script = str(REPO / "train.py")
    if nproc == 0:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=timeout)


def train_ok(nproc: int, dump_dir: Path, *overrides: str, **kw) -> list[dict]:
    proc = train(nproc, dump_dir, *overrides, **kw)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return metrics(dump_dir)


def metrics(dump_dir: Path) -> list[dict]:
    path = dump_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def losses(records: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records}
