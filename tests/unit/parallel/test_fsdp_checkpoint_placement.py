"""Activation checkpointing around an FSDP unit from outside: non-reentrant gives the unit's true
gradients; reentrant (whose forward runs without grad) is refused instead of silently freezing the unit."""

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallel.fsdp import FSDPConfig, fully_shard
from parallel.fsdp.flat_param import unflatten


class TwoLinears(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.reentrant = nn.Linear(4, 4), nn.Linear(4, 4), reentrant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.b, self.a(x), use_reentrant=self.reentrant)


def _train(model: nn.Module, inputs: list[torch.Tensor], world) -> object:
    root = fully_shard(model, ["a", "b"], world, None, FSDPConfig(optimize_backward_concat=True))
    for i, x in enumerate(inputs):
        root.set_microbatch(i == 0, i == len(inputs) - 1)
        model(x).pow(2).sum().backward()
    root.finish_gradient_sync()
    return root


def test_checkpoint_around_a_unit(world):
    inputs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    reference = TwoLinears(reentrant=False)
    sum(reference(x).pow(2).sum() for x in inputs).backward()

    root = _train(TwoLinears(reentrant=False), inputs, world)
    for unit, module in zip(root.units, (reference.a, reference.b)):
        got = unflatten(unit.flat_param.grad, unit.spec)
        assert torch.allclose(got["weight"], module.weight.grad) and torch.allclose(got["bias"], module.bias.grad)

    with pytest.raises(RuntimeError, match="reentrant activation checkpoint around an FSDP unit"):
        _train(TwoLinears(reentrant=True), inputs, world)
