"""A unit's parameters read from the module outside its forward and backward: while the unit is
sharded they are meta tensors of the right shapes (reading a value is an error), never views of the
freed unsharded buffer, whose read would be of freed memory (it crashed the process)."""

import copy

import pytest
import torch
from torch import nn

from parallel.activation_checkpoint import checkpoint_forward
from parallel.fsdp import FSDPConfig, fully_shard
from tests.unit.parallel.toy_blocks import two_blocks


def _shard(model: nn.Module, world, reshard_after_forward: bool):
    return fully_shard(model, ["0", "1"], world, None, FSDPConfig(reshard_after_forward=reshard_after_forward))


def test_a_sharded_units_parameters_are_shapes_without_values(world):
    model = two_blocks()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    _shard(model, world, reshard_after_forward=True)
    assert model[0].a.weight.is_meta and model[0].a.weight.shape == shapes["0.a.weight"]
    with torch.no_grad():
        model(torch.randn(2, 8))
    for name, shape in shapes.items():
        value = getattr(model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2])
        assert value.is_meta and value.shape == shape, name
    with pytest.raises((RuntimeError, NotImplementedError), match="meta"):
        model[1].b.bias.sum().item()


def test_an_unsharded_unit_shows_the_gathered_values(world):
    reference = two_blocks()
    model = copy.deepcopy(reference)
    _shard(model, world, reshard_after_forward=False)  # ZeRO-2: unsharded from the forward on
    with torch.no_grad():
        out = model(torch.randn(2, 8))
    assert not model[0].a.weight.is_meta and torch.equal(model[0].a.weight, reference[0].a.weight)
    assert out.shape == (2, 8)


def test_a_recompute_in_backward_reads_the_regathered_views(world):
    """checkpoint_forward recomputes a unit's forward in its backward from the module's attributes:
    under ZeRO-3 they are valid again once the backward re-gathers, and the gradients are exact."""
    reference = two_blocks()
    model = copy.deepcopy(reference)
    for block in model:
        checkpoint_forward(block)
    root = _shard(model, world, reshard_after_forward=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    root.set_microbatch(True, True)
    model(x).pow(2).sum().backward()
    root.finish_gradient_sync()
    reference(x).pow(2).sum().backward()
    for unit, block in zip(root.units, reference):
        want = torch.cat([p.grad.reshape(-1) for p in block.parameters()])
        assert torch.allclose(unit.flat_param.grad[: want.numel()], want, atol=1e-6)
    assert model[0].a.weight.is_meta  # resharded after its backward
