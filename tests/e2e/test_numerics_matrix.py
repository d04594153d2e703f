"""scripts/numerics_matrix.sh at CPU size, row a (tp2 pp2 dp2 in fp8, with model.fp8_wgrad=true and
reshard_after_forward=false): bitwise equal with optimize_backward_concat off and on. The other rows'
layouts are checked for the same bitwise equality in-process, each 8-rank launch pair here costing
about a minute of CI: b (tp2 dp4 bf16, microbatches) by tests/distributed/test_fp8.py, c-e (bf16
gpipe, 1f1b, interleaved on tp2 pp2 dp2 with SP) by test_pipeline.py::test_tp_pp_dp_composition."""

import subprocess

from tests.e2e.launch import ENV, REPO


def _matrix(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/numerics_matrix.sh", *args], cwd=REPO, env=ENV, capture_output=True,
                          text=True, timeout=1200)


def test_numerics_matrix_cpu(tmp_path):
    proc = _matrix("--out", str(tmp_path), "--rows", "a")
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in proc.stdout.splitlines()[2:]}
    assert set(rows) == {"a tp2 pp2 dp2 fp8 gpipe"}, rows
    for name, result in rows.items():
        assert result.startswith("bitwise equal over 4 steps; TFLOP/s"), (name, result)


def test_numerics_matrix_refuses_an_unknown_row_or_a_selection_of_none():
    proc = _matrix("--rows", "a,q")
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --rows: no row 'q' (rows: a b c d e)", proc.stderr
    for rows in ("", "a b", "a,"):  # would select nothing, and an empty matrix would pass
        proc = _matrix("--rows", rows)
        assert proc.returncode == 2 and proc.stderr.startswith("error: --rows takes row letters"), (rows, proc.stderr)
