"""mem_snapshot_stop_step on CPU observes without changing what it measures: sampling the optimizer
state during step 1 must not allocate Adam's moments ahead of the first update."""

import json

import torch

from tests.distributed.pipeline_cases import config, make_trainer
from trainer.observability.memory import MemorySnapshots


def test_step_1_breakdown_holds_no_optimizer_state(world, tmp_path, monkeypatch):
    trainer = make_trainer(config(batch_size=1, steps=1), 1)
    memory = MemorySnapshots(1, 0, tmp_path, 0, torch.device("cpu"), trainer.roots, trainer.optimizer)
    before_update = []
    update = trainer.optimizer.step

    def step(lr: float) -> None:
        before_update.append(len(trainer.optimizer.allocated_state()))
        update(lr)

    monkeypatch.setattr(trainer.optimizer, "step", step)
    with memory.recording(1):
        trainer.train_step(1)
    memory.after_step(1)
    assert before_update == [0]  # forward and backward under the hooks left the optimizer without state
    report = json.loads((tmp_path / "memory_snapshots" / "rank0_live_bytes.json").read_text())
    assert report["peak_step"] == 1 and report["peak_bytes"]["activations"] > 0
    assert report["peak_bytes"]["optimizer_state"] == 0
