"""The trainer's own step (build_trainer + Trainer.train_step) on synthetic global batches, any layout.

Every layout sees the same global batch per step, so losses compare across layouts exactly as in
training; the process group is the test's, the mesh is built per run.
"""

import json

import torch

from parallel.mesh import ParallelMesh
from parallel.pipeline.schedule import downstream, upstream
from trainer.config import TrainConfig, from_dict
from trainer.loop import Trainer
from trainer.metrics import StepMetrics
from trainer.run import build_trainer
from trainer.validate import validate

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


def make_trainer(cfg: TrainConfig, world: int, validate_as: TrainConfig | None = None) -> Trainer:
    """`validate_as`: the config validated in cfg's place (one that validation would refuse on this
    machine, e.g. TransformerEngine blocks on CPU, is validated as its twin)."""
    dims = validate(validate_as or cfg, world)
    mesh = ParallelMesh(dims, "cpu")
    loader = SyntheticLoader(cfg.batch_size * dims.dp, mesh.dp_rank, dims.dp, cfg.microbatch_size)
    return build_trainer(cfg, mesh, loader, torch.device("cpu"))


def train(cfg: TrainConfig, world: int) -> tuple[Trainer, list[StepMetrics]]:
    trainer = make_trainer(cfg, world)
    return trainer, [trainer.train_step(step) for step in range(1, cfg.steps + 1)]


def write_reference_losses(rank: int, world: int, global_batches: list[int], path: str) -> None:
    """One process, no parallelism: the losses of each global batch size, for the layouts to match."""
    out = {g: [m.loss for m in train(config(batch_size=g), 1)[1]] for g in global_batches}
    with open(path, "w") as f:
        json.dump(out, f)


def read_reference_losses(path: str) -> dict[int, list[float]]:
    with open(path) as f:
        return {int(g): losses for g, losses in json.load(f).items()}


def expected_p2p(cfg: TrainConfig, pp_rank: int) -> int:
    """Sends per step of one pipeline rank: each local chunk passes every microbatch's activation
    forward (unless it is the last stage) and its input gradient backward (unless the first)."""
    pp, vpp, m = cfg.pipeline_parallel_size, cfg.virtual_pipeline_stages, cfg.num_microbatches
    stages = [chunk * pp + pp_rank for chunk in range(vpp)]
    return m * sum((downstream(s, "F", pp * vpp) is not None) + (upstream(s, "F", pp * vpp) is not None) for s in stages)
