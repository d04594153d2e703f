"""What a flat parameter cannot represent is refused when the model is sharded, never trained wrongly:
a frozen parameter inside a unit (the flat parameter would train it), a weight tied across two units
(each would get its own copy, trained apart), and a unit with nothing to shard; nor does a unit left
unsharded compute with weights older than its shard, nor a backward with weights newer than its forward's."""

import pytest
import torch
from torch import nn

from parallel.fsdp import FSDPConfig, fully_shard


class TwoLinears(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)


def test_a_frozen_parameter_inside_a_unit_is_refused(world):
    model = TwoLinears()
    model.b.bias.requires_grad_(False)
    with pytest.raises(ValueError, match=r"^FSDP unit b: b.bias has requires_grad=False, but the unit's flat"):
        fully_shard(model, ["a", "b"], world, None, FSDPConfig())


def test_a_weight_tied_across_two_units_is_refused(world):
    model = TwoLinears()
    model.b.weight = model.a.weight
    with pytest.raises(ValueError, match=r"^parameter b.weight is also in FSDP unit a \(tied weights\)"):
        fully_shard(model, ["a", "b"], world, None, FSDPConfig())


def test_a_unit_without_parameters_is_refused(world):
    model = TwoLinears()
    model.c = nn.ReLU()
    with pytest.raises(ValueError, match=r"^FSDP unit c has no parameters"):
        fully_shard(model, ["a", "b", "c"], world, None, FSDPConfig())


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_a_unit_left_unsharded_regathers_a_shard_changed_in_place(world, reshard_after_forward):
    """ZeRO-2 keeps a unit unsharded after its forward: an in-place change of its shard meanwhile (an
    optimizer step or a load outside the trainer's step, which reshards) must not leave the next
    forward on the old gathered weights."""
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    root = fully_shard(model, ["0", "1"], world, None, FSDPConfig(reshard_after_forward=reshard_after_forward))
    x = torch.randn(5, 4)
    with torch.no_grad():
        before = model(x)
        for unit in root.units:
            unit.flat_param.mul_(0.5)
        after = model(x)
        root.reshard()
        regathered = model(x)
    assert not torch.equal(before, after) and torch.equal(after, regathered)


@pytest.mark.parametrize("fused", [False, True])
def test_a_unit_left_unsharded_regathers_after_the_optimizers_step(world, fused):
    """The same through our AdamW: its fused kernel writes the shard in place without bumping the version
    counter the unit reads, so a bf16 unit left unsharded computed with the pre-step weights."""
    from trainer.config.schema import OptimConfig
    from trainer.optimizer import NamedAdamW

    model = nn.Sequential(nn.Linear(4, 4))
    root = fully_shard(model, ["0"], world, None, FSDPConfig(compute_dtype=torch.bfloat16,
                                                             reshard_after_forward=False))
    optimizer = NamedAdamW([model], OptimConfig(lr=0.1, fused=fused))
    x = torch.ones(1, 4, dtype=torch.bfloat16)
    with torch.no_grad():
        model(x)  # a forward without backward: the unit stays unsharded
    unit = root.units[0]
    unit.flat_param.grad = torch.ones_like(unit.flat_param)
    optimizer.step(0.1)
    with torch.no_grad():
        after = model(x)
        root.reshard()
        assert torch.equal(after, model(x))


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_changed_between_a_forward_and_its_backward_are_refused(world, reshard_after_forward, dtype):
    """Plain autograd refuses a backward through weights changed in place since the forward; a unit's
    gathered weights do not share the shard's version counter, so its backward re-gathered the changed
    shard and mixed it with the old activations, silently."""
    model = TwoLinears()
    root = fully_shard(model, ["a", "b"], world, None, FSDPConfig(compute_dtype=dtype,
                                                                  reshard_after_forward=reshard_after_forward))
    loss = model.b(model.a(torch.ones(2, 4, dtype=dtype))).sum()
    with torch.no_grad():
        root.units[1].flat_param.add_(0.5)
    with pytest.raises(RuntimeError, match=r"^FSDP unit b: its parameters changed in place between a forward "):
        loss.backward()


@pytest.mark.parametrize("grad_reduce", ["last_microbatch", "per_microbatch"])
def test_gradients_of_a_step_that_raised_midway_are_refused_at_the_next_step(world, grad_reduce):
    """A step that raises after its first microbatch's backward leaves that gradient in the units'
    accumulators (or their per-step shard sums); the next step would silently reduce it with its own."""
    model = TwoLinears()
    root = fully_shard(model, ["a", "b"], world, None, FSDPConfig(grad_reduce=grad_reduce))
    x = torch.randn(3, 2, 4, generator=torch.Generator().manual_seed(0))

    def microbatch(i: int, last: int) -> None:
        if i == 0:
            root.begin_step()
        root.set_microbatch(is_first=i == 0, is_last=i == last)
        model.b(model.a(x[i])).pow(2).sum().backward()

    microbatch(0, last=2)  # the step raises here, before microbatch 1
    with pytest.raises(RuntimeError, match=r"^FSDP unit a holds gradients of a step that did not finish"):
        microbatch(0, last=2)
    for unit in root.units:  # what a clean step leaves: nothing to refuse
        unit.grad_accumulator = unit.shard_grad_sum = None
    for i in range(3):
        microbatch(i, last=2)
    root.finish_gradient_sync()
    microbatch(0, last=0)
    root.finish_gradient_sync()
