"""Flat parameters: a unit's parameters concatenated into one 1-D tensor, padded, sharded evenly.

The layout depends only on the unit's parameter names and shapes (registration order, a tied copy
first), its padding and the shard-group size, so any rank, and any offline tool, can rebuild it. Rank r
owns elements [r * shard_size, (r + 1) * shard_size) of the padded flat tensor; the padding is the tail.
"""

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class FlatParamSpec:
    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]
    world: int
    min_numel: int = 0  # padded to at least this many elements: units holding copies of one weight align (tied.py)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(s.numel() for s in self.shapes)

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def shard_size(self) -> int:
        return -(-max(self.total, self.min_numel) // self.world)

    @property
    def padded(self) -> int:
        return self.shard_size * self.world

    @classmethod
    def of_module(cls, module: torch.nn.Module, world: int, first: str | None = None,
                  min_numel: int = 0) -> "FlatParamSpec":
        """The layout of a module's parameters in registration order, but `first` (a tied copy) first."""
        named = sorted(module.named_parameters(), key=lambda item: item[0] != first)  # stable: the rest keep order
        return cls(tuple(n for n, _ in named), tuple(p.shape for _, p in named), world, min_numel)

    def valid_in_shard(self, rank: int) -> int:
        """How many of rank's shard elements are real (not padding)."""
        return max(0, min(self.shard_size, self.total - rank * self.shard_size))

    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)


def flatten(tensors: list[torch.Tensor], spec: FlatParamSpec) -> torch.Tensor:
    """fp32 padded flat tensor of the given (full) tensors, in spec order."""
    flat = torch.zeros(spec.padded, dtype=torch.float32, device=tensors[0].device if tensors else None)
    torch.cat([t.detach().reshape(-1).float() for t in tensors], out=flat[: spec.total])
    return flat


def shard_of(flat: torch.Tensor, spec: FlatParamSpec, rank: int) -> torch.Tensor:
    return flat[rank * spec.shard_size : (rank + 1) * spec.shard_size].clone()


def split_views(flat: torch.Tensor, spec: FlatParamSpec) -> list[torch.Tensor]:
    """Per-parameter views of an unsharded flat tensor (in spec order)."""
    return [chunk.view(shape) for chunk, shape in zip(torch.split(flat[: spec.total], spec.numels), spec.shapes)]


def free_storage(t: torch.Tensor) -> None:
    """Release a buffer's memory but keep the tensor (and every view of it) for a later refill."""
    t.untyped_storage().resize_(0)


def allocate_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


def unflatten(flat: torch.Tensor, spec: FlatParamSpec) -> dict[str, torch.Tensor]:
    """Name -> tensor (copies) of a full flat tensor: for export and tests."""
    return {name: view.clone() for name, view in zip(spec.names, split_views(flat, spec))}


def trainable_owners(name: str, module: nn.Module, spec: FlatParamSpec) -> list[tuple[nn.Module, str]]:
    """(owning submodule, attribute) of each parameter the unit flattens; every one must train."""
    if not spec.names:
        raise ValueError(f"FSDP unit {name} has no parameters (nothing to shard): leave it out of the units")
    owners = [(module.get_submodule(n.rpartition(".")[0]), n.rpartition(".")[2]) for n in spec.names]
    frozen = [n for n, (sub, attr) in zip(spec.names, owners) if not getattr(sub, attr).requires_grad]
    if frozen:
        raise ValueError(f"FSDP unit {name}: {name}.{frozen[0]} has requires_grad=False, but the unit's flat "
                         f"parameter trains every element it holds (the frozen one would be trained)")
    return owners


def aliases_shard(world: int, compute_dtype: torch.dtype, fp8_all_gather: bool) -> bool:
    """Whether a unit's unsharded parameter is its shard itself: one rank computing in fp32, with no fp8
    gather, has nothing to gather or cast (no copy, no second weights)."""
    return world == 1 and compute_dtype == torch.float32 and not fp8_all_gather
