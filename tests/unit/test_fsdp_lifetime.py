"""A trained FSDP model is freed with its last reference. A reference cycle through an autograd node
or a tensor hook is invisible to the garbage collector: one that reached a unit would keep the unit,
and its process groups, alive past destroy_process_group, until interpreter exit, where gloo's
threads can abort a run that succeeded."""

import gc
import weakref

import pytest

from parallel.fsdp import FSDPConfig
from tests.distributed.fsdp_cases import train_fsdp


@pytest.mark.parametrize("optimize_backward_concat", [False, True])
@pytest.mark.parametrize("reshard_after_forward", [False, True])
def test_units_are_freed_after_training(world, optimize_backward_concat, reshard_after_forward):
    cfg = FSDPConfig(optimize_backward_concat=optimize_backward_concat, reshard_after_forward=reshard_after_forward)
    root, _ = train_fsdp(cfg, world, None, 0, 1, 3, 2)
    units = [weakref.ref(unit) for unit in root.units]
    del root
    gc.collect()
    assert [u() for u in units] == [None] * len(units)
