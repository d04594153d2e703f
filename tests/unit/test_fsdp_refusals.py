"""What a flat parameter cannot represent is refused when the model is sharded, never trained wrongly:
a frozen parameter inside a unit (the flat parameter would train it), a weight tied across two units
(each would get its own copy, trained apart), and a unit with nothing to shard."""

import pytest
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
