"""compile=true end to end (one process, model=tiny): the compile line once, after step 1, with the pinned
flash kernel (CPU has one); the losses those of the eager run within 1e-4; and the kernels CPU lacks, one
`error:` line naming the device before anything trains."""

import pytest

from tests.e2e.launch import assert_one_error, losses, metrics, train, train_ok

TINY = ("model=tiny", "model.n_layers=2", "seq_len=32", "steps=3", "log_all_steps=true", "batch_size=2")


def test_compile_logs_once_and_trains_as_eager(tmp_path):
    proc = train(0, tmp_path / "compiled", *TINY, "compile=true", "model.efficient_attn=flash")
    assert proc.returncode == 0, proc.stderr[-5000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("compile: ")]
    assert len(lines) == 1 and " graphs compiled in " in lines[0], proc.stderr[-3000:]
    compiled = losses(metrics(tmp_path / "compiled"))
    eager = losses(train_ok(0, tmp_path / "eager", *TINY, "model.efficient_attn=flash"))
    assert sorted(eager) == sorted(compiled) == [1, 2, 3]
    for step, loss in eager.items():
        assert abs(compiled[step] - loss) <= 1e-4 * abs(loss), (step, compiled[step], loss)


@pytest.mark.parametrize("kernel", ["cutlass", "cudnn"])
def test_a_kernel_cpu_lacks_is_one_line(tmp_path, kernel):
    proc = train(0, tmp_path / kernel, *TINY, f"model.efficient_attn={kernel}")
    assert_one_error(proc, f"model.efficient_attn={kernel}: this device (cpu) has no {kernel} attention kernel")
    assert not (tmp_path / kernel / "metrics.jsonl").exists()
