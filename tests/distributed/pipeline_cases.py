"""The trainer's own step (StepRunner.build + StepRunner.train_step) on synthetic global batches, any layout.

Every layout sees the same global batch per step, so losses compare across layouts exactly as in
training; the process group is the test's, the mesh is built per run.
"""

import json
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from parallel.fsdp import unit as fsdp_unit
from parallel.mesh import ParallelDims, ParallelMesh
from parallel.pipeline.layers import rank_stages, stage_place
from parallel.pipeline.schedule import downstream, upstream
from parallel.random import RNGStreams
from trainer.checkpoint.state import checkpoint_state
from trainer.config.rules import validate
from trainer.config.schema import TrainConfig, from_dict
from trainer.observability.metrics import StepMetrics
from trainer.step import StepRunner

MODEL = {"name": "tiny", "n_layers": 8, "dim": 32, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 64, "multiple_of": 16}
SEQ = 8
STEPS = 3


def config(**overrides) -> TrainConfig:
    model = MODEL | overrides.pop("model", {})
    raw = {"model": model, "seq_len": SEQ, "steps": STEPS, "optim": {"lr": 1e-3, "warmup_steps": 1}} | overrides
    return from_dict(raw)


class SyntheticLoader:
    """Random tokens; the global batch of step s is the same for every layout, split over dp ranks."""

    def __init__(self, global_batch: int, dp_rank: int, dp: int, microbatch_size: int):
        self.global_batch, self.dp_rank, self.dp, self.microbatch_size = global_batch, dp_rank, dp, microbatch_size

    def batch(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(1000 + step)
        tokens = torch.randint(0, MODEL["vocab_size"], (self.global_batch, SEQ + 1), generator=gen)
        per_rank = self.global_batch // self.dp
        mine = tokens[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        size = self.microbatch_size
        return [(mine[i : i + size, :-1], mine[i : i + size, 1:]) for i in range(0, per_rank, size)]


class FixedSampler:
    """What checkpoint_state needs of a sampler, for SyntheticLoader's fixed batches."""

    def state_dict(self) -> dict[str, int]:
        return {"global_batch_size": 8}

    def check_resumable(self, saved: dict[str, int]) -> None:
        assert saved["global_batch_size"] == self.state_dict()["global_batch_size"], saved


def checkpoint_state_of(trainer: StepRunner, rank: int, step: int) -> dict:
    """The trainer's checkpoint state, as the Trainer gives it."""
    rng = RNGStreams(0, trainer.chunks[0].tp.rank, torch.device("cpu"))
    return checkpoint_state(trainer.roots, trainer.optimizer, rng, FixedSampler(), step, rank, trainer.mesh.dims)


_MESHES: dict[ParallelDims, ParallelMesh] = {}


def mesh_of(dims: ParallelDims) -> ParallelMesh:
    """One mesh per layout for the life of the test's process group (whoever destroys that group calls
    forget_meshes): a mesh's groups hold no training state, and each mesh adds dozens of gloo threads per
    rank, which made a 4-rank test of 50 runs crawl and slowed every process beside it."""
    if dims not in _MESHES:
        _MESHES[dims] = ParallelMesh(dims, "cpu")
    return _MESHES[dims]


def forget_meshes() -> None:
    """Drop the cached meshes: their groups die with the process group about to be destroyed."""
    _MESHES.clear()


def make_trainer(cfg: TrainConfig, world: int, validate_as: TrainConfig | None = None) -> StepRunner:
    """`validate_as`: the config validated in cfg's place (one that validation would refuse on this
    machine, e.g. TransformerEngine blocks on CPU, is validated as its twin)."""
    dims = validate(validate_as or cfg, world)
    mesh = mesh_of(dims)
    loader = SyntheticLoader(cfg.batch_size * dims.dp, mesh.dp_rank, dims.dp, cfg.microbatch_size)
    return StepRunner.build(cfg, mesh, loader, torch.device("cpu"))


def train(cfg: TrainConfig, world: int) -> tuple[StepRunner, list[StepMetrics]]:
    trainer = make_trainer(cfg, world)
    return trainer, [trainer.train_step(step) for step in range(1, cfg.steps + 1)]


Reference = dict[str, list[float]]  # "loss" and "grad_norm", per step


def reference_of(metrics: list[StepMetrics]) -> Reference:
    return {"loss": [m.loss for m in metrics], "grad_norm": [m.grad_norm for m in metrics]}


def write_references(rank: int, world: int, global_batches: list[int], path: str, steps: int = STEPS,
                     model: dict | None = None) -> None:
    """One process, no parallelism: losses and gradient norms of each global batch size, for the
    layouts to match (the norm catches a gradient that is off by a constant factor, which Adam's
    normalized update hides from the losses). `model`: overrides of MODEL."""
    out = {g: reference_of(train(config(batch_size=g, steps=steps, model=model or {}), 1)[1]) for g in global_batches}
    with open(path, "w") as f:
        json.dump(out, f)


def read_references(path: str) -> dict[int, Reference]:
    with open(path) as f:
        return {int(g): ref for g, ref in json.load(f).items()}


def assert_matches(metrics: list[StepMetrics], reference: Reference, label: str, rel: float = 1e-5) -> None:
    """Every step's loss and gradient norm within `rel` of the reference's."""
    for key, want in reference.items():
        got = reference_of(metrics)[key]
        assert len(got) == len(want), (label, key, got, want)
        for step, (a, b) in enumerate(zip(got, want), 1):
            assert abs(a - b) <= rel * abs(b), f"{label} step {step} {key}: {a} vs {b}"


def expected_p2p(cfg: TrainConfig, pp_rank: int) -> int:
    """Sends per step of one pipeline rank: each local chunk passes every microbatch's activation
    forward (unless it is the last stage) and its input gradient backward (unless the first), over the
    network unless the other stage is on this rank (the V's turn under zbv)."""
    pp, vpp, m, v_shape = cfg.pipeline_parallel_size, cfg.virtual_pipeline_stages, cfg.num_microbatches, cfg.pipeline_v_shape
    stages = rank_stages(pp, vpp, pp_rank, v_shape)
    peers = [other(s, "F", pp * vpp) for s in stages for other in (downstream, upstream)]
    return m * sum(peer is not None and stage_place(peer, pp, v_shape)[0] != pp_rank for peer in peers)


@contextmanager
def counting_concats() -> Iterator[list[int]]:
    """Counts the flat-gradient concats autograd runs (the backward of a unit's connected parameter
    views, CONCAT_EVENT in a profile) in a one-element list: a profiler's events cost minutes to
    parse across the pipeline tests' runs, a counter nothing."""
    count, backward = [0], fsdp_unit._FlatParamSplitWithSizes.backward

    def counted(ctx, *grads):
        count[0] += 1
        return backward(ctx, *grads)

    fsdp_unit._FlatParamSplitWithSizes.backward = staticmethod(counted)
    try:
        yield count
    finally:
        fsdp_unit._FlatParamSplitWithSizes.backward = staticmethod(backward)
