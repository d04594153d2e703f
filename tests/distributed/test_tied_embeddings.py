"""model.tie_embeddings through the trainer's step on 4 gloo ranks. pp=2 x dp=2 holds the embedding on the
first stage and a copy of it as the head on the last: after every step the two copies are bitwise equal,
and the losses and gradient norms are those of pp=1 x dp=4, whose one parameter serves both (1e-5); the
copies' gradient sum is one all-reduce a step, in the ledger.
A checkpoint stores the weight once: written under pp=2 it continues under pp=1, and written under pp=1
under pp=2, as the run that did not stop. The check every save makes sees a copy that differs."""

from pathlib import Path

import torch
import torch.distributed as dist

from parallel import comm
from parallel.fsdp import tied_copies_equal
from parallel.random import RNGStreams
from tests.distributed.pipeline_cases import (
    FixedSampler, assert_matches, checkpoint_state_of, config, make_trainer, reference_of,
)
from tests.distributed.spawn import run_ranks
from trainer.checkpoint.files import checkpoint_keys, save_checkpoint
from trainer.checkpoint.state import load_into
from trainer.step import StepRunner

LAYOUTS = {"pp2 dp2": dict(pipeline_parallel_size=2, batch_size=2), "pp1 dp4": dict(batch_size=1)}  # global 4


def _copy(trainer: StepRunner) -> torch.Tensor | None:
    """This rank's piece of its copy of the tied weight (first in its unit's flat parameter), if any."""
    for unit in (u for root in trainer.roots for u in root.units if u.tied is not None):
        held = min(unit.spec.shard_size, unit.spec.numels[0] - unit.rank * unit.spec.shard_size)
        return unit.flat_param.detach()[: max(held, 0)].clone()
    return None


def _assert_copies_equal(trainer: StepRunner, step: int) -> None:
    """Each first-stage rank's piece against its last-stage partner's (same dp rank), bit for bit."""
    mine = (trainer.mesh.rank_in("pp"), trainer.mesh.dp_rank, _copy(trainer))
    pieces = [None] * dist.get_world_size()
    dist.all_gather_object(pieces, mine)
    first = {dp: piece for pp, dp, piece in pieces if pp == 0}
    last = {dp: piece for pp, dp, piece in pieces if pp == 1}
    assert first.keys() == last.keys() == {0, 1}
    for dp, piece in first.items():
        assert torch.equal(piece.view(torch.int32), last[dp].view(torch.int32)), (step, dp)
    assert tied_copies_equal(trainer.roots, trainer.tied_group, dist.group.WORLD)


def _check(rank: int, world: int, root: str) -> None:
    cfgs = {name: config(model={"tie_embeddings": True}, steps=4, **layout) for name, layout in LAYOUTS.items()}
    metrics, saved = {}, {}
    for name, cfg in cfgs.items():
        trainer = make_trainer(cfg, world)
        metrics[name] = []
        for step in range(1, 5):
            metrics[name].append(trainer.train_step(step))
            # The ledger counts the gradient sum: one all-reduce over the embedding group, pp > 1 only.
            assert comm.LEDGER.count("all_reduce", "embedding") == (name == "pp2 dp2"), name
            if name == "pp2 dp2":
                _assert_copies_equal(trainer, step)
            if step == 2:  # resumed below for steps 3 (the weights) and 4 (Adam's moments of the tied weight)
                state = checkpoint_state_of(trainer, rank, step)
                saved[name] = save_checkpoint(Path(root) / name, step, state, dist.group.WORLD, rank, {})
        keys = checkpoint_keys(saved[name])
        assert "model.tok_embeddings.weight" in keys and not any("head.output" in k for k in keys), name
    assert_matches(metrics["pp2 dp2"], reference_of(metrics["pp1 dp4"]), "pp2 dp2 against pp1 dp4")

    for source, target in (("pp2 dp2", "pp1 dp4"), ("pp1 dp4", "pp2 dp2")):
        trainer = make_trainer(cfgs[target], world)
        rng = RNGStreams(0, 0, torch.device("cpu"))
        assert load_into(saved[source], checkpoint_state_of(trainer, rank, 0), rng, FixedSampler(),
                         dist.group.WORLD) == 2
        resumed = [trainer.train_step(step) for step in (3, 4)]
        assert_matches(resumed, reference_of(metrics[source][2:]), f"{source} checkpoint on {target}")

    # A copy that differs (one bit of the last stage's on dp rank 0) is seen on every rank.
    if trainer.mesh.rank_in("pp") == 1 and trainer.mesh.dp_rank == 0:
        flat = trainer.roots[-1].units[-1].flat_param.detach()
        flat.view(torch.int32)[0] ^= 1
    assert not tied_copies_equal(trainer.roots, trainer.tied_group, dist.group.WORLD)


def test_tied_copies_on_pp2_stay_equal_match_pp1_and_checkpoints_move_between_them(tmp_path):
    run_ranks(4, _check, str(tmp_path))
