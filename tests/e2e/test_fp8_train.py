"""fp8 training end to end (torchrun train.py): it tracks fp32, and its scaling state is checkpointed,
so a resume continues bitwise, and on another layout continues the same run."""

import math
import shutil

from tests.e2e.launch import losses, train_ok
from trainer.checkpoint.files import checkpoint_keys

TINY = ("model=tiny", "seq_len=64", "batch_size=2", "log_all_steps=true")


def test_fp8_loss_tracks_fp32_over_40_steps(tmp_path):
    fp32 = losses(train_ok(0, tmp_path / "fp32", *TINY, "steps=40"))
    fp8 = losses(train_ok(0, tmp_path / "fp8", *TINY, "steps=40", "model.use_fp8=true"))
    assert fp8[40] < fp8[1] - 1.0  # it learns
    assert math.isclose(fp8[40], fp32[40], rel_tol=0.05), (fp8[40], fp32[40])
    assert fp8[40] != fp32[40]  # and the GEMMs really ran in fp8


def test_fp8_resume_is_bitwise_and_continues_on_tp2(tmp_path):
    """dp2 with the fp8 all-gather: steps 4-6 resumed from the straight run's own step-3 checkpoint equal
    the straight run's. Resumed on tp2 instead, each amax history and scale goes to the same GEMM of the
    same layer (amaxes are reduced over the whole model-parallel and data-parallel group, so the scales
    do not depend on the layout): steps 4-6 agree to fp32 rounding (2e-8 here). Scaling state dropped at
    the resume moves step 4's loss by 1e-5: the tolerance tells them apart."""
    fp8 = (*TINY, "model.use_fp8=true", "model.fp8_all_gather=true", "model.fp8_amax_history_len=4",
           "checkpoint.freq=3")
    straight = losses(train_ok(2, tmp_path / "straight", *fp8, "steps=6"))
    step_3 = tmp_path / "straight" / "checkpoints" / "step_3"
    keys = checkpoint_keys(step_3)
    assert "fp8.layers.0.attention.wqkv.gemm.scale" in keys and "fp8.layers.1.feed_forward.w2.gemm.amax_history" in keys
    shutil.copytree(step_3, tmp_path / "resumed" / "checkpoints" / "step_3")
    resumed = losses(train_ok(2, tmp_path / "resumed", *fp8, "steps=6"))
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == straight[step], (step, resumed[step], straight[step])

    relaid = tmp_path / "tp2"
    shutil.copytree(step_3, relaid / "checkpoints" / "step_3")
    tp2 = losses(train_ok(2, relaid, *fp8, "steps=6", "model_parallel_size=2", "batch_size=4"))
    assert sorted(tp2) == [4, 5, 6]
    for step in (4, 5, 6):
        assert math.isclose(tp2[step], straight[step], rel_tol=1e-6), (step, tp2[step], straight[step])
