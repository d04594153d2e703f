"""model.use_te_layers wiring on CPU: the trainer's model with TransformerEngine blocks (model/te.py) run on
a CPU stand-in of TE's modules (tests/fake_te) trains exactly like the in-tree blocks under
tp x SP x FSDP (ZeRO-3, optimize_backward_concat) and tp x pp (1F1B and ZB-H1): the same parameters, names and
initial values, TE's weight gradients written into FSDP's accumulator through main_grad, the
scheduler's first-microbatch marks reaching TE's forward, and TE's autocast entered with the amax
group. With fp8, TE's scaling state goes into checkpoints and a resume continues it bitwise.
TransformerEngine itself is checked by the GPU tests (tests/gpu/test_te.py)."""

import dataclasses
import sys
from pathlib import Path

import torch

from model.args import ModelArgs
from model.te import TEBlocks
from parallel.random import RNGStreams
from tests.distributed.pipeline_cases import (
    FixedSampler, assert_matches, checkpoint_state_of, config, make_trainer, reference_of, train,
)
from tests.distributed.spawn import run_ranks
from trainer.checkpoint.files import save_checkpoint
from trainer.checkpoint.state import load_into
from trainer.config.schema import TrainConfig
from trainer.observability.metrics import StepMetrics
from trainer.step import StepRunner

FAKE_TE = Path(__file__).resolve().parents[1] / "fake_te"
LAYOUTS = {
    "tp2 sp dp2 zero3 concat": dict(model_parallel_size=2, model={"sequence_parallel": True}, batch_size=2,
                                   optimize_backward_concat=True),
    "tp2 pp2 1f1b zero2": dict(model_parallel_size=2, pipeline_parallel_size=2, batch_size=4,
                               reshard_after_forward=False),
    # TE writes its weight gradients in B; the reduction still waits for W.
    "tp2 pp2 zb_h1 zero3": dict(model_parallel_size=2, pipeline_parallel_size=2, batch_size=4, pipeline_schedule="zb_h1"),
}


def _te_trainer(cfg: TrainConfig, world: int) -> StepRunner:
    """The trainer with TE blocks; validated as its in-tree twin (validate refuses TE without CUDA)."""
    twin = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, use_te_layers=False))
    trainer = make_trainer(cfg, world, validate_as=twin)
    assert all(type(b).__name__ == "TETransformerBlock" for c in trainer.chunks for b in c.layers.values())
    return trainer


def _te_metrics(cfg: TrainConfig, world: int) -> list[StepMetrics]:
    trainer = _te_trainer(cfg, world)
    return [trainer.train_step(step) for step in range(1, cfg.steps + 1)]


def _te_scaling(trainer: StepRunner) -> dict[str, torch.Tensor]:
    return {f"{i}.{name}": t.clone() for i, block in enumerate(b for c in trainer.chunks for b in c.layers.values())
            for name, t in block.scaling_state().items()}


def _check_fp8_resume(rank: int, world: int, root: str) -> None:
    """TE fp8 (the stand-in's delayed scaling): 3 steps, a checkpoint, 3 more, against a new trainer
    that loads the checkpoint and takes the same 3 steps: same scaling state, losses bitwise."""
    cfg = config(model_parallel_size=2, batch_size=8, microbatch_size=2, reshard_after_forward=False, steps=6,
                 model={"use_te_layers": True, "use_fp8": True, "fp8_amax_history_len": 4})
    straight = _te_trainer(cfg, world)
    for step in range(1, 4):
        straight.train_step(step)
    world_group = torch.distributed.group.WORLD
    saved = save_checkpoint(Path(root), 3, checkpoint_state_of(straight, rank, 3), world_group, rank, {})
    at_step_3 = _te_scaling(straight)
    assert len(at_step_3) == 8 * 4 * 4 and all(t.dtype == torch.float32 for t in at_step_3.values())
    assert all((t != 1).any() for name, t in at_step_3.items() if name.endswith("scaling_fwd.scale")), at_step_3
    want = [straight.train_step(step).loss for step in range(4, 7)]

    resumed = _te_trainer(cfg, world)
    rng = RNGStreams(0, 0, torch.device("cpu"))
    assert load_into(saved, checkpoint_state_of(resumed, rank, 0), rng, FixedSampler(), world_group) == 3
    for name, t in _te_scaling(resumed).items():
        assert torch.equal(t, at_step_3[name]), name
    got = [resumed.train_step(step).loss for step in range(4, 7)]
    assert got == want, (got, want)


def _check(rank: int, world: int, root: str) -> None:
    sys.path.insert(0, str(FAKE_TE))
    import transformer_engine.pytorch as fake_te

    _check_fp8_resume(rank, world, root)
    for label, layout in LAYOUTS.items():
        fake_te.AUTOCAST_REGIONS.clear(), fake_te.FIRST_MICROBATCH_FLAGS.clear(), fake_te.MAIN_GRAD_WRITES.clear()
        cfg = config(**{**layout, "model": {**layout.get("model", {}), "use_te_layers": True}})
        # The gradient norm too: a main_grad write off by a constant factor leaves Adam's losses alike.
        assert_matches(_te_metrics(cfg, world), reference_of(train(config(**layout), world)[1]), label)
        assert len(fake_te.MAIN_GRAD_WRITES) > 0, label
        # ZeRO-2: the marks reach TE, which caches fp8 weight casts; ZeRO-3: None, so TE keeps no copy.
        flags = {True, False} if layout.get("reshard_after_forward") is False else {None}
        assert set(fake_te.FIRST_MICROBATCH_FLAGS) == flags, (label, set(fake_te.FIRST_MICROBATCH_FLAGS))
        enabled, recipe, group = fake_te.AUTOCAST_REGIONS[0]
        assert not enabled and recipe is None, label  # fp32 run: TE's autocast entered with fp8 off
        pp = layout.get("pipeline_parallel_size", 1)
        assert group.size() == world // pp, (label, group.size())  # dp x cp x tp: the in-tree amax group
        assert all(entry[2] is group for entry in fake_te.AUTOCAST_REGIONS), label


def test_te_blocks_train_like_the_in_tree_blocks(tmp_path):
    run_ranks(4, _check, str(tmp_path))


def test_te_region_runs_fp8_only_for_forwards_with_grad(monkeypatch):
    """Evaluation (no grad) runs TE blocks with fp8 off: TE's amax history cannot forget a forward."""
    monkeypatch.syspath_prepend(str(FAKE_TE))
    try:
        import transformer_engine.pytorch as fake_te

        blocks = TEBlocks(ModelArgs(use_fp8=True), amax_group=None)
        with blocks.region():
            pass
        with torch.no_grad(), blocks.region():
            pass
        assert [(enabled, recipe is not None) for enabled, recipe, _ in fake_te.AUTOCAST_REGIONS[-2:]] == [
            (True, True), (False, True)]
    finally:
        for name in [m for m in sys.modules if m.startswith("transformer_engine")]:
            del sys.modules[name]
