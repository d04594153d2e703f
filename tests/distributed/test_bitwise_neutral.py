"""Options that change how a step runs, not what it computes: with each one the trainer's step gives
bitwise the losses and gradient norms it gives without it (2 gloo ranks). Memory and speed options a
numerics experiment may toggle freely: reshard_after_forward, activation recompute (full and selective),
nan_policy=skip while every value is finite, and the gpipe and 1F1B schedules."""

from tests.distributed.pipeline_cases import config, reference_of, train
from tests.distributed.spawn import run_ranks

DP2 = dict(batch_size=2, steps=3)
NEUTRAL_ON_DP2 = {
    "reshard_after_forward=false": dict(reshard_after_forward=False),
    "model.layer_ckpt=full": dict(model={"layer_ckpt": "full"}),
    "model.layer_ckpt=selective": dict(model={"layer_ckpt": "selective"}),
    "nan_policy=skip": dict(nan_policy="skip"),
}
PP2 = dict(pipeline_parallel_size=2, batch_size=4, steps=3)


def _check(rank: int, world: int) -> None:
    base = reference_of(train(config(**DP2), world)[1])
    for label, option in NEUTRAL_ON_DP2.items():
        assert reference_of(train(config(**DP2 | option), world)[1]) == base, label
    gpipe, one_f_one_b = (reference_of(train(config(**PP2, pipeline_schedule=s), world)[1]) for s in ("gpipe", "1f1b"))
    assert gpipe == one_f_one_b, (gpipe, one_f_one_b)


def test_options_that_leave_the_step_bitwise_unchanged():
    run_ranks(2, _check)
