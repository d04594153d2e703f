"""The microbatch protocol: one concat per unit per step, bitwise on/off, no silent gradient loss,
checkpointing without extra all-gathers, sharded memory, and the global grad norm."""

from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.profiler import profile
from torch.utils.checkpoint import checkpoint

import parallel.fsdp.unit as fsdp_unit
from parallel import comm
from parallel.fsdp import CONCAT_EVENT, FSDPConfig, grad_norm
from parallel.fsdp.hooks import in_backward
from tests.distributed.fsdp_cases import ARGS, GLOBAL_BATCH, SEQ, UNITS, global_batch, loss_sum, make_model, train_fsdp
from tests.distributed.spawn import run_ranks
from trainer.parallelize import apply_activation_checkpointing

M = 4


def _world_groups():
    return dist.group.WORLD, None, dist.get_rank(), dist.get_world_size()


def _concats_per_step(optimize: bool) -> int:
    """Flat-gradient concats the autograd engine executed in one step: backward nodes of the connected
    parameter views, and no SplitWithSizesBackward over the flat parameter's 1-D chunks either."""
    shard, rep, rank, world = _world_groups()
    with profile(record_shapes=True) as prof:
        train_fsdp(FSDPConfig(optimize_backward_concat=optimize), shard, rep, rank, world, M, 1)
    assert not any(e.name == "SplitWithSizesBackward0" and all(len(shape) == 1 for shape in e.input_shapes)
                   for e in prof.function_events)
    return sum(1 for e in prof.function_events if e.name == CONCAT_EVENT)


def _check_concats(rank: int, world: int) -> None:
    assert _concats_per_step(optimize=True) == len(UNITS)
    assert _concats_per_step(optimize=False) == len(UNITS) * M
    # The one concat is the last microbatch's (earlier ones are cut), and it adds the view gradients into
    # the accumulator the earlier microbatches filled, in place: no second unit-sized flat gradient.
    shard, rep, rank, world = _world_groups()
    marks: list[tuple[str, bool]] = []

    def record_flat_grads(root) -> None:
        for unit in root.units:
            unit.receive_view_grads = partial(record_then_receive, unit, unit.receive_view_grads)

    def record_then_receive(unit, receive, grads, ticket) -> None:
        accumulator = unit.grad_accumulator
        receive(grads, ticket)
        assert unit.grad_accumulator is accumulator is not None, unit.name
        marks.append((unit.name, unit.is_last_microbatch))

    train_fsdp(FSDPConfig(optimize_backward_concat=True), shard, rep, rank, world, M, 1, on_root=record_flat_grads)
    assert sorted(marks) == sorted((name, True) for name in UNITS), marks


def _check_bitwise_on_off(rank: int, world: int) -> None:
    shard, rep, rank, world = _world_groups()
    for dtype, steps in ((torch.float32, 5), (torch.bfloat16, 5)):
        for reshard in (False, True):
            runs = [
                train_fsdp(FSDPConfig(compute_dtype=dtype, reshard_after_forward=reshard, optimize_backward_concat=opt),
                           shard, rep, rank, world, M, steps)
                for opt in (False, True)
            ]
            assert runs[0][1] == runs[1][1], (dtype, reshard, runs[0][1], runs[1][1])
            for a, b in zip(runs[0][0].units, runs[1][0].units):
                assert torch.equal(a.flat_param, b.flat_param), (dtype, reshard, a.name)


def _no_grad_views(unit) -> list[torch.Tensor]:
    """The hazard: views made entirely under no_grad have no grad_fn and silently drop gradients."""
    with torch.no_grad():
        chunks = torch.split(unit.full[: unit.spec.total], unit.spec.numels)
        return [c.view(s) for c, s in zip(chunks, unit.spec.shapes)]


def _check_no_grad_hazard_is_caught(rank: int, world: int) -> None:
    shard, rep, rank, world = _world_groups()
    original = fsdp_unit._cut_views
    fsdp_unit._cut_views = _no_grad_views
    try:
        with pytest.raises(RuntimeError, match="lost their autograd edge"):
            train_fsdp(FSDPConfig(optimize_backward_concat=True), shard, rep, rank, world, 2, 1)
    finally:
        fsdp_unit._cut_views = original


class _CheckpointOutside(nn.Module):
    """Checkpoint wrapped around an FSDP unit: recompute re-enters the unit's forward hooks."""

    def __init__(self, unit_module: nn.Module):
        super().__init__()
        self.inner = unit_module

    def forward(self, *args):
        return checkpoint(self.inner, *args, use_reentrant=False)


def _wrap_blocks_outside(model) -> None:
    for i in list(model.layers):
        block = model.layers[i]
        model.layers[i] = _CheckpointOutside(block)
        model.layers[i].inner = block  # the unit stays the block itself: its name is layers.i.inner


def _check_checkpointing_adds_no_all_gather(rank: int, world: int) -> None:
    shard, rep, rank, world = _world_groups()
    for reshard in (False, True):
        cfg = FSDPConfig(reshard_after_forward=reshard, optimize_backward_concat=True)
        gathers, losses = {}, {}
        for label, prepare in (("none", None), ("full", lambda m: apply_activation_checkpointing(m, "full")),
                               ("selective", lambda m: apply_activation_checkpointing(m, "selective"))):
            counts = []
            _, losses[label] = train_fsdp(cfg, shard, rep, rank, world, M, 2, lambda s, r: counts.append(
                comm.LEDGER.count("all_gather")), prepare)
            gathers[label] = counts[-1]
        assert gathers["none"] == len(UNITS) * (2 * M if reshard else 1)
        assert gathers["full"] == gathers["selective"] == gathers["none"], gathers
        assert losses["full"] == losses["selective"] == losses["none"]
        _check_outside_placement(cfg, reshard)


def _check_outside_placement(cfg: FSDPConfig, reshard: bool) -> None:
    from parallel.fsdp import fully_shard

    model = make_model()
    _wrap_blocks_outside(model)
    root = fully_shard(model, ["tok_embeddings", "layers.0.inner", "layers.1.inner", "head"], dist.group.WORLD, None, cfg)
    rank = dist.get_rank()
    inputs, targets = (t[rank * 8 : (rank + 1) * 8] for t in global_batch(0))
    comm.LEDGER.reset()
    for i, (x, y) in enumerate(zip(inputs.chunk(M), targets.chunk(M))):
        root.set_microbatch(i == 0, i == M - 1)
        (loss_sum(model, x, y) / (GLOBAL_BATCH * SEQ)).backward()
    root.finish_gradient_sync()
    assert comm.LEDGER.count("all_gather") == len(UNITS) * (2 * M if reshard else 1)


def _check_memory_and_grad_norm(rank: int, world: int) -> None:
    """Per rank, parameter + gradient + Adam-state elements are 1/dp_shard of the unsharded model's
    (plus the padding that makes the flat parameters divisible), all fp32."""
    shard, rep, rank, world = _world_groups()
    norms, grad_numel = [], []

    def on_step(step, root):
        norms.append(grad_norm([root], [root.shard_group]))
        grad_numel.append(sum(u.flat_param.grad.numel() for u in root.units))

    root, _ = train_fsdp(FSDPConfig(), shard, rep, rank, world, M, 1, on_step)
    full_numel = sum(p.numel() for p in make_model().parameters())
    padding = sum(u.spec.padded - u.spec.total for u in root.units)
    assert padding < len(UNITS) * world
    params = [u.flat_param for u in root.units]
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    state_numel = sum(t.numel() for st in opt.state.values() for k, t in st.items() if k != "step")
    local = sum(p.numel() for p in params)
    assert local * world == grad_numel[0] * world == state_numel * world // 2 == full_numel + padding
    assert all(p.dtype == torch.float32 for p in params)
    assert all(u.state is fsdp_unit.UnitState.SHARDED for u in root.units)  # nothing unsharded between steps
    reference = make_model()
    inputs, targets = global_batch(0)
    (loss_sum(reference, inputs, targets) / (GLOBAL_BATCH * SEQ)).backward()
    expected = torch.sqrt(sum(p.grad.pow(2).sum() for p in reference.parameters())).item()
    assert norms[0] == pytest.approx(expected, rel=1e-5)


def _check_prefetch_and_bf16_bytes(rank: int, world: int) -> None:
    """Each unit's all-gather is issued one unit ahead: in forward before the unit's forward runs, in
    backward before the following unit (in forward order) finishes its backward. All-gathers move
    compute-dtype (bf16) bytes, reduce-scatters reduce_dtype (fp32) bytes."""
    shard, rep, rank, world = _world_groups()
    events = []
    originals = {name: getattr(fsdp_unit.FSDPUnit, name) for name in ("start_unshard", "reshard")}

    def logged(name):
        def method(unit):
            if name != "start_unshard" or unit.state is fsdp_unit.UnitState.SHARDED:
                events.append((name, unit.name, in_backward()))
            return originals[name](unit)
        return method

    def log_forwards(model):
        for unit_name in UNITS:
            model.get_submodule(unit_name).register_forward_pre_hook(
                lambda m, a, n=unit_name: events.append(("forward", n, False)))

    for name in originals:
        setattr(fsdp_unit.FSDPUnit, name, logged(name))
    ledgers = []
    try:
        cfg = FSDPConfig(compute_dtype=torch.bfloat16, reshard_after_forward=True)
        root, _ = train_fsdp(cfg, shard, rep, rank, world, 1, 1, lambda s, r: ledgers.append(comm.LEDGER.by_op()),
                             log_forwards)
    finally:
        for name, method in originals.items():
            setattr(fsdp_unit.FSDPUnit, name, method)
    for earlier, later in zip(UNITS, UNITS[1:]):
        assert events.index(("start_unshard", later, False)) < events.index(("forward", later, False)), events
        assert events.index(("start_unshard", earlier, True)) < events.index(("reshard", later, True)), events
    padded = sum(u.spec.padded for u in root.units)
    assert ledgers[0]["all_gather"]["bytes"] == 2 * padded * 2  # bf16, forward + backward (ZeRO-3, M=1)
    assert ledgers[0]["reduce_scatter"]["bytes"] == 4 * padded  # fp32


def _all_checks(rank: int, world: int) -> None:
    _check_concats(rank, world)
    _check_bitwise_on_off(rank, world)
    _check_no_grad_hazard_is_caught(rank, world)
    _check_checkpointing_adds_no_all_gather(rank, world)
    _check_memory_and_grad_norm(rank, world)
    _check_prefetch_and_bf16_bytes(rank, world)


def test_microbatch_protocol():
    assert ARGS.n_layers == 2
    run_ranks(2, _all_checks)
