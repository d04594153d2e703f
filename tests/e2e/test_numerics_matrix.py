"""scripts/numerics_matrix.sh at CPU size: every row is bitwise equal with optimize_backward_concat off
and on (row a in fp8, with model.fp8_wgrad=true and reshard_after_forward=false)."""

import subprocess

from tests.e2e.launch import ENV, REPO


def test_numerics_matrix_cpu(tmp_path):
    proc = subprocess.run(["bash", "scripts/numerics_matrix.sh", "--out", str(tmp_path)], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in proc.stdout.splitlines()[2:]}
    for name in ("a tp2 pp2 dp2 fp8 gpipe", "b tp2 dp4 bf16 microbatches", "c tp2 pp2 dp2 bf16 gpipe", "d tp2 pp2 dp2 bf16 1f1b",
                 "e tp2 pp2 dp2 bf16 interleaved vpp=2"):
        assert rows[name].startswith("bitwise equal over 3 steps; TFLOP/s"), (name, rows[name])
