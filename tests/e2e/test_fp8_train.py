"""fp8 training end to end (torchrun train.py): it tracks fp32, and its scaling state is checkpointed,
so a resume continues bitwise."""

import math

from tests.e2e.launch import died_before_saving, losses, metrics, train_ok
from trainer.checkpoint import checkpoint_keys

TINY = ("model=tiny", "seq_len=64", "batch_size=2", "log_all_steps=true")


def test_fp8_loss_tracks_fp32_over_40_steps(tmp_path):
    fp32 = losses(train_ok(0, tmp_path / "fp32", *TINY, "steps=40"))
    fp8 = losses(train_ok(0, tmp_path / "fp8", *TINY, "steps=40", "model.use_fp8=true"))
    assert fp8[40] < fp8[1] - 1.0  # it learns
    assert math.isclose(fp8[40], fp32[40], rel_tol=0.05), (fp8[40], fp32[40])
    assert fp8[40] != fp32[40]  # and the GEMMs really ran in fp8


def test_fp8_resume_is_bitwise(tmp_path):
    """dp2 with the fp8 all-gather: steps 4-6 after a resume from step 3 equal a straight run's."""
    fp8 = (*TINY, "model.use_fp8=true", "model.fp8_all_gather=true", "model.fp8_amax_history_len=4")
    straight = losses(train_ok(2, tmp_path / "straight", *fp8, "steps=6"))
    resumed_dir = tmp_path / "resumed"
    train_ok(2, resumed_dir, *fp8, "steps=4", "optim.decay_steps=6", "checkpoint.freq=3")
    died_before_saving(resumed_dir, 4)
    keys = checkpoint_keys(resumed_dir / "checkpoints" / "step_3")
    assert "fp8.layers.0.attention.wqkv.gemm.scale" in keys and "fp8.layers.1.feed_forward.w2.gemm.amax_history" in keys
    train_ok(2, resumed_dir, *fp8, "steps=6", "checkpoint.freq=3")
    resumed = losses(metrics(resumed_dir))
    for step in (4, 5, 6):
        assert resumed[step] == straight[step], (step, resumed[step], straight[step])
