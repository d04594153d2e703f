"""scripts/gpu_check.sh on a machine without CUDA: one line saying so and exit 1, before any test or run
(CI's machines have no GPU; the GPU run itself is the script's job on a CUDA machine)."""

import subprocess

from tests.e2e.launch import REPO


def test_without_cuda_it_says_so_in_one_line_and_fails(tmp_path) -> None:
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), str(tmp_path / "out")], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env={"PATH": "/usr/bin:/bin",
                                                                            "CUDA_VISIBLE_DEVICES": ""})
    assert done.returncode == 1
    assert done.stderr == "gpu_check: no CUDA device on this machine\n" and not (tmp_path / "out").exists()
