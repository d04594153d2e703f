"""FSDP shards as DTensors for torch.distributed.checkpoint.

Each rank saves the unpadded part of its shard as a DTensor of global shape [tp, flat length]: row r
is TP rank r's (TP-local) flat parameter, sharded along its length over the shard mesh. Our shard
boundaries are exactly DTensor's Shard chunking (ceil(n/w) per rank), so DCP records every chunk at
its global offset: a checkpoint loads into any dp_shard size, and an offline tool can read every TP
rank's whole flat tensor. HSDP replicas save identical chunks, which DCP deduplicates.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh

from parallel.fsdp.unit import FSDPUnit

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def shard_as_dtensor(unit: FSDPUnit, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """Wrap (without copying) this rank's unpadded shard of `local`, a tensor shaped like the shard.

    `mesh` is the 2-D (shard group, tp) device mesh."""
    # torch.distributed.tensor costs ~0.6 s of imports per process: paid only when a checkpoint is used.
    from torch.distributed.tensor import DTensor, Shard

    valid = unit.spec.valid_in_shard(unit.rank)
    shape = torch.Size([unit.tp.size, unit.spec.total])
    return DTensor.from_local(
        local.detach()[:valid].unsqueeze(0), mesh, [Shard(1), Shard(0)], run_check=False, shape=shape,
        stride=(unit.spec.total, 1),
    )
