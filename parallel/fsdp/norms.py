"""L2 norms of sharded state: the global gradient norm (clipping, metrics) and, for numerics work,
per-unit gradient and parameter norms.

A rank holds its shard of each unit's flat parameter (and gradient), of its TP slice, of its pipeline
chunks. Square sums of those pieces add up to the whole model's over the ranks that hold distinct
pieces (the caller's groups: shard x TP x pipeline); TP-replicated elements (norm weights) are counted
on TP rank 0 only (the unit's norm_mask).
"""

import torch
from torch.distributed import ProcessGroup

from parallel import comm
from parallel.fsdp.root import FSDPRoot
from parallel.fsdp.unit import FSDPUnit


def _square_sum(unit: FSDPUnit, values: torch.Tensor) -> torch.Tensor:
    """fp32, as the global gradient norm has always been summed (its bitwise claims rest on it)."""
    squares = values.float().pow(2)
    return (squares if unit.norm_mask is None else squares * unit.norm_mask).sum()


def _square_sum_fp64(unit: FSDPUnit, values: torch.Tensor) -> torch.Tensor:
    kept = values if unit.norm_mask is None else values * unit.norm_mask  # the mask is 0 or 1: exact
    return torch.linalg.vector_norm(kept, dtype=torch.float64).square()


def _grad_square_sum(root: FSDPRoot) -> torch.Tensor:
    """Sum of squares of this rank's gradient elements."""
    total = torch.zeros((), dtype=torch.float32, device=root.units[0].flat_param.device)
    for unit in root.units:
        if unit.flat_param.grad is not None:
            total += _square_sum(unit, unit.flat_param.grad)
    return total


def grad_norm(roots: list[FSDPRoot], groups: list[ProcessGroup]) -> float:
    """Global L2 norm of the gradients of several roots (e.g. one per pipeline chunk). Shards are
    disjoint over the shard group, TP slices over TP, chunks over pipeline stages: the square sums
    add up over `groups`, which together must span exactly those ranks (one group in the trainer)."""
    total = sum(_grad_square_sum(root) for root in roots)
    for group in groups:
        if group.size() > 1:
            comm.all_reduce(total, group)
    return total.sqrt().item()


def unit_norms(roots: list[FSDPRoot], names: list[str], group: ProcessGroup) -> dict[str, dict[str, float]]:
    """{"grad": {unit: norm}, "param": {unit: norm}} for every unit of the model (`names`, all pipeline
    stages'), in one all-reduce over `group`, which must span exactly the ranks holding distinct pieces.
    A unit without a gradient this step counts as 0. Summed in fp64 and given as fp32 values, so that
    layouts (other partial sums) give the same numbers, which compare_runs can then tell apart from a
    change."""
    index = {name: i for i, name in enumerate(names)}
    device = roots[0].units[0].flat_param.device
    sums = torch.zeros(2, len(names), dtype=torch.float64, device=device)
    for unit in (u for root in roots for u in root.units):
        if unit.flat_param.grad is not None:
            sums[0, index[unit.name]] = _square_sum_fp64(unit, unit.flat_param.grad)
        sums[1, index[unit.name]] = _square_sum_fp64(unit, unit.flat_param.detach())
    if group.size() > 1:
        comm.all_reduce(sums, group, label="unit norms")
    norms = sums.sqrt().float().tolist()
    return {kind: dict(zip(names, row)) for kind, row in zip(("grad", "param"), norms)}
