"""The README's demo command, as written (shortened by an override), trains and the loss falls."""

import os
import subprocess

from tests.e2e.launch import REPO, metrics


def test_readme_demo_command(tmp_path):
    readme = (REPO / "README.md").read_text()
    assert "bash scripts/demo.sh" in readme and "bash scripts/test.sh" in readme
    dump = tmp_path / "demo"
    proc = subprocess.run(
        ["bash", "scripts/demo.sh", "steps=30", f"dump_dir={dump}", "log_all_steps=true", "checkpoint.freq=0"],
        cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = metrics(dump)
    assert [r["step"] for r in records] == list(range(1, 31))
    assert records[-1]["loss"] < records[0]["loss"] - 1.0, [r["loss"] for r in records]
