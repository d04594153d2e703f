"""Shard a model into FSDP units and drive them per microbatch and per step.

The caller (the step loop, or the pipeline runtime for each stage) names the units in forward order,
calls `begin_step` before a step's first forward, tells the root `is_first_microbatch` /
`is_last_microbatch` before each microbatch, and calls `finish_gradient_sync` once after the last
microbatch's backward. Every unit that got gradients in a
step must run with grad on the step's last microbatch, where its gradient is reduced.
"""

from torch import nn
from torch.distributed import ProcessGroup

from parallel.fsdp.reductions import ReductionQueue
from parallel.fsdp.hooks import register_hooks
from parallel.fsdp.tied import TiedCopy
from parallel.fsdp.unit import FSDPConfig, FSDPUnit, Initializer, TPGroups, UnitState


class FSDPRoot:
    def __init__(self, units: list[FSDPUnit], shard_group: ProcessGroup, reductions_in_flight: int):
        self.units = units
        self.shard_group = shard_group
        self.reductions = ReductionQueue(reductions_in_flight)
        self._index = {id(u): i for i, u in enumerate(units)}

    def set_microbatch(self, is_first: bool | None, is_last: bool) -> None:
        """Call before the forward AND before the backward of each microbatch: a pipeline schedule
        may run another microbatch's forward in between, and both passes read these flags."""
        for unit in self.units:
            unit.set_microbatch(is_first, is_last)

    def begin_step(self) -> None:
        """Before a step's first forward: no unit may hold gradients yet (main_grad units bind their
        accumulator at that forward, so the first microbatch's marks come too late to tell)."""
        for unit in self.units:
            _refuse_gradients_of_an_unfinished_step(unit)

    def clear_microbatch(self) -> None:
        """Back to unmarked once the scheduler's step (or evaluation) is over, as before the first:
        a forward it does not drive (a probe, generation) then casts its fp8 weights afresh rather than
        reuse the cast of weights the optimizer has since changed, and reduces its own gradients."""
        for unit in self.units:
            unit.set_microbatch(None, True)

    def prefetch_next(self, unit: FSDPUnit) -> None:
        """Forward: start the next unit's all-gather (at most one ahead)."""
        i = self._index[id(unit)] + 1
        if i < len(self.units) and self.units[i].state is UnitState.SHARDED:
            self.units[i].start_unshard()

    def prefetch_previous(self, unit: FSDPUnit) -> None:
        """Backward runs units in reverse: start the previous unit's all-gather."""
        i = self._index[id(unit)] - 1
        if i >= 0 and self.units[i].state is UnitState.SHARDED:
            self.units[i].start_unshard()

    def finish_gradient_sync(self) -> None:
        """After the last microbatch's backward: land async reductions and free unsharded params."""
        self.reductions.drain()
        for unit in self.units:
            unit.reshard()
            _refuse_unreduced_gradients(unit)

    def record_fp8_weight_amaxes(self) -> None:
        """Each fp8 GEMM records the amax of its weight's piece of this rank's shards (no communication)."""
        for unit in self.units:
            unit.record_fp8_weight_amaxes()

    def reshard(self) -> None:
        """Free every unit's unsharded parameters (e.g. after forward-only passes)."""
        for unit in self.units:
            unit.reshard()


def _refuse_unreduced_gradients(unit: FSDPUnit) -> None:
    """At the end of a step every gradient of the unit has been reduced into its shard's .grad."""
    if unit.gradients_pending:
        raise RuntimeError(f"FSDP unit {unit.name}: {unit.gradients_pending} forward pass(es) with grad got no gradient")
    if unit.grad_accumulator is not None or unit.shard_grad_sum is not None:
        raise RuntimeError(
            f"FSDP unit {unit.name} got gradients on earlier microbatches of the step but did not run with grad on "
            f"its last one, where the step's gradient is reduced: it would be left out of this step and added into "
            f"the next; run every unit on the step's last microbatch")


def _refuse_gradients_of_an_unfinished_step(unit: FSDPUnit) -> None:
    """A step starts with no gradient accumulated: one left by a step that raised after some backward
    passes (before finish_gradient_sync) would be reduced into this step's gradient."""
    if unit.grad_accumulator is not None or unit.shard_grad_sum is not None:
        raise RuntimeError(f"FSDP unit {unit.name} holds gradients of a step that did not finish (it raised after "
                           "some microbatches' backward): they would be added into this step's; restore the model "
                           "and optimizer from a checkpoint before stepping again")


def fully_shard(
    model: nn.Module, unit_names: list[str], shard_group: ProcessGroup, replicate_group: ProcessGroup | None,
    cfg: FSDPConfig, tp: TPGroups | None = None, init: Initializer | None = None, tied: TiedCopy | None = None,
    spans: dict[str, str] | None = None,
) -> FSDPRoot:
    """Turn each named submodule (forward order) into an FSDP unit; every parameter must be in one.
    Parameters are the TP-local ones; those marked `tp_dim=None` (or unmarked) are TP-replicated.
    For a model built on the meta device, `init` gives the initial value of the boxes each rank's shard
    holds, unit by unit (see FSDPUnit). `tied`: the model's copy of a weight other chunks hold copies of
    too (tied.py). `spans`: {unit: the submodule ("" the model) whose forward spans every use of the
    unit's parameters}, for a unit whose weight another module reads as well (a tied output head): the
    unit is gathered from the start of that forward to its end, and again for its whole backward."""
    _refuse_parameters_shared_between_units(model, unit_names)
    spans = spans or {}
    units = [FSDPUnit(name, model.get_submodule(name), shard_group, replicate_group, cfg, tp, init,
                      tied if tied is not None and tied.param.startswith(f"{name}.") else None)
             for name in unit_names]
    stray = [n for n, _ in model.named_parameters() if not n.endswith("flat_param")]
    if stray:
        raise ValueError(f"parameters outside every FSDP unit: {', '.join(stray)}")
    root = FSDPRoot(units, shard_group, cfg.reductions_in_flight)
    for unit in units:
        register_hooks(unit, root, model.get_submodule(spans.get(unit.name, unit.name)))
    return root


def _refuse_parameters_shared_between_units(model: nn.Module, unit_names: list[str]) -> None:
    """Tied weights in two units would become two flat copies, each trained on its own gradient."""
    owner: dict[int, str] = {}
    for unit_name in unit_names:
        for name, param in model.get_submodule(unit_name).named_parameters():
            if owner.setdefault(id(param), unit_name) != unit_name:
                raise ValueError(f"parameter {unit_name}.{name} is also in FSDP unit {owner[id(param)]} (tied "
                                 f"weights): each unit would train its own copy; put the modules that share it in one unit")
