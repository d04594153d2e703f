"""FSDP shards as DTensors for torch.distributed.checkpoint.

Each rank saves the unpadded part of its shard as a DTensor of global shape [tp, flat length]: row r
is TP rank r's (TP-local) flat parameter, sharded along its length over the shard mesh. Our shard
boundaries are exactly DTensor's Shard chunking (ceil(n/w) per rank), so DCP records every chunk at
its global offset: a checkpoint loads into any dp_shard size, and an offline tool can read every TP
rank's whole flat tensor. HSDP replicas save identical chunks, which DCP deduplicates.
"""

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from parallel.fsdp.unit import FSDPUnit


def shard_as_dtensor(unit: FSDPUnit, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """Wrap (without copying) this rank's unpadded shard of `local`, a tensor shaped like the shard.

    `mesh` is the 2-D (shard group, tp) device mesh."""
    valid = unit.spec.valid_in_shard(unit.rank)
    shape = torch.Size([unit.tp.size, unit.spec.total])
    return DTensor.from_local(
        local.detach()[:valid].unsqueeze(0), mesh, [Shard(1), Shard(0)], run_check=False, shape=shape,
        stride=(unit.spec.total, 1),
    )
