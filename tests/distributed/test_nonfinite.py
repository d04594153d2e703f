"""nan_policy on 2 gloo ranks with a NaN injected into ONE rank's gradient of one unit at step 2: `skip`
leaves that step's update out on both ranks (weights and Adam state untouched, counted) and training
goes on; `halt` stops both ranks before the update, naming the step and the unit."""

import math

import pytest
import torch

from model.fp8 import fp8_gemms
from tests.distributed.pipeline_cases import config, make_trainer
from tests.distributed.spawn import run_ranks

NAN_STEP, NAN_RANK, NAN_UNIT = 2, 1, 2  # unit 2 in forward order: layers.1


def _inject_nan(trainer, rank: int) -> None:
    """After the gradient sync of step NAN_STEP, one rank's shard of one unit gets a NaN."""
    root = trainer.roots[0]
    finish = root.finish_gradient_sync
    steps = {"n": 0}

    def finish_with_nan() -> None:
        finish()
        steps["n"] += 1
        if steps["n"] == NAN_STEP and rank == NAN_RANK:
            root.units[NAN_UNIT].flat_param.grad[0] = float("nan")

    root.finish_gradient_sync = finish_with_nan


def _weights(trainer) -> list[torch.Tensor]:
    return [u.flat_param.detach().clone() for root in trainer.roots for u in root.units]


def _check(rank: int, world: int) -> None:
    trainer = make_trainer(config(batch_size=2, steps=4, nan_policy="skip"), world)
    _inject_nan(trainer, rank)
    metrics = [trainer.train_step(1)]
    before = _weights(trainer)
    metrics.append(trainer.train_step(2))
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(trainer)))  # no update, on every rank
    assert math.isnan(metrics[1].grad_norm) and metrics[1].skipped_steps == 1
    metrics += [trainer.train_step(3), trainer.train_step(4)]
    assert all(math.isfinite(m.loss) and math.isfinite(m.grad_norm) for m in metrics[2:])
    assert [m.skipped_steps for m in metrics] == [0, 1, 1, 1]
    assert not all(torch.equal(a, b) for a, b in zip(before, _weights(trainer)))  # training went on

    # What a checkpoint carries (the optimizer's state) keeps the count: a resumed trainer reports it.
    resumed = make_trainer(config(batch_size=2, steps=5, nan_policy="skip"), world)
    for name, slot in resumed.optimizer.state().items():
        for key, value in slot.items():
            value.copy_(trainer.optimizer.state()[name][key])
    assert resumed.train_step(5).skipped_steps == 1

    trainer = make_trainer(config(batch_size=2, steps=4), world)  # nan_policy=halt, the default
    _inject_nan(trainer, rank)
    trainer.train_step(1)
    before = _weights(trainer)
    with pytest.raises(FloatingPointError, match=r"step 2: .*gradient norm nan; the first non-finite gradient is in unit layers\.1"):
        trainer.train_step(2)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(trainer)))


def _check_fp8_skip(rank: int, world: int) -> None:
    """A skipped step's amaxes (here one rank's NaN) never enter the fp8 history: the scaling state after
    the skipped step is the one before it, finite, and the next steps scale on."""
    model = {"n_layers": 4, "dim": 32, "n_heads": 2, "n_kv_heads": 2, "use_fp8": True}
    trainer = make_trainer(config(model=model, batch_size=2, microbatch_size=2, steps=4, nan_policy="skip"), world)
    _inject_nan(trainer, rank)
    gemms = fp8_gemms(trainer.chunks)
    finish = trainer.roots[0].finish_gradient_sync

    def finish_with_nan_amax() -> None:
        finish()
        if trainer_steps["n"] == NAN_STEP and rank == NAN_RANK:
            gemms[0].amax_history[0, 2] = float("nan")  # this step's output-gradient amax

    trainer_steps = {"n": 0}
    trainer.roots[0].finish_gradient_sync = finish_with_nan_amax
    for step in (1, 2, 3, 4):
        trainer_steps["n"] = step
        before = [torch.cat([g.scale, g.amax_history.flatten()]) for g in gemms]
        metrics = trainer.train_step(step)
        after = [torch.cat([g.scale, g.amax_history.flatten()]) for g in gemms]
        assert all(torch.isfinite(a).all() for a in after), step
        if step == NAN_STEP:
            assert metrics.skipped_steps == 1 and all(torch.equal(a, b) for a, b in zip(before, after))
        else:  # every other step records its amaxes (a new history row) and rescales
            assert all(not torch.equal(a, b) for a, b in zip(before, after)), step
    assert metrics.skipped_steps == 1


def test_nan_policy_skip_and_halt():
    run_ranks(2, _check)


def test_a_skipped_step_leaves_fp8_scaling_untouched():
    run_ranks(2, _check_fp8_skip)
