"""What holds process groups is freed before they are destroyed, and a step leaves nothing behind.

A group still referenced at destroy_process_group lives until interpreter exit, where gloo's threads can
abort a run that succeeded. A reference cycle through an autograd node or a tensor hook is invisible to
the garbage collector: one that reached an FSDP unit kept the unit and its groups alive; one through a
microbatch's parameter views leaked host memory every step. A failed run's traceback frames, and a
function default evaluated after init, hold them too."""

import gc
import subprocess
import sys
import weakref

import pytest
import torch

from parallel.fsdp import FSDPConfig
from tests.distributed.fsdp_cases import train_fsdp
from trainer.run import _without_frames


def _tensors_alive() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


@pytest.mark.parametrize("optimize_backward_concat", [False, True])
@pytest.mark.parametrize("reshard_after_forward", [False, True])
def test_units_are_freed_after_training(world, optimize_backward_concat, reshard_after_forward):
    cfg = FSDPConfig(optimize_backward_concat=optimize_backward_concat, reshard_after_forward=reshard_after_forward)
    root, _ = train_fsdp(cfg, world, None, 0, 1, 3, 2)
    units = [weakref.ref(unit) for unit in root.units]
    del root
    gc.collect()
    assert [u() for u in units] == [None] * len(units)


@pytest.mark.parametrize("optimize_backward_concat", [False, True])
def test_training_leaves_no_tensor_behind(world, optimize_backward_concat):
    cfg = FSDPConfig(optimize_backward_concat=optimize_backward_concat)
    before = _tensors_alive()
    train_fsdp(cfg, world, None, 0, 1, 4, 3)
    assert _tensors_alive() == before


PINNED_DEFAULTS = """
import tempfile, torch, torch.distributed as dist
import parallel.mesh  # what every entry point imports before its process group exists
dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/store", rank=0, world_size=1)
x = torch.ones(2, requires_grad=True)
torch.utils.checkpoint.checkpoint(torch.sin, x, use_reentrant=False)  # imports torch.distributed.nn lazily
from torch.distributed.nn import functional
pinned = [f for f in vars(functional).values() if any(isinstance(d, dist.ProcessGroup) for d in getattr(f, "__defaults__", None) or ())]
print(len(pinned))
dist.destroy_process_group()
"""


def test_no_function_default_pins_the_default_group():
    """torch.distributed.nn.functional takes group=WORLD as a default argument, evaluated at import; imported
    after init (activation checkpointing does), it would keep the default group alive past its destruction."""
    out = subprocess.run([sys.executable, "-c", PINNED_DEFAULTS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[-1] == "0", out.stdout


class _Trainer:
    """Stands in for what a failed step's frames hold (the trainer, its units, their groups)."""


def _failing_step(refs: list) -> None:
    trainer = _Trainer()
    refs.append(weakref.ref(trainer))
    raise RuntimeError("step 7 failed")


def test_a_failed_run_keeps_its_traceback_as_text_and_frees_what_its_frames_held():
    refs: list = []
    try:
        _failing_step(refs)
    except RuntimeError as e:
        error = _without_frames(e)
    gc.collect()
    assert refs[0]() is None
    assert error.__traceback__ is None and str(error) == "step 7 failed"
    assert "in _failing_step" in error.__notes__[0] and 'raise RuntimeError("step 7 failed")' in error.__notes__[0]
