"""FSDP shards as DTensors for torch.distributed.checkpoint.

Each rank saves the unpadded part of its shard as a DTensor of the unit's full flat length, sharded
on dim 0 over the shard mesh. Our shard boundaries are exactly DTensor's Shard(0) chunking (ceil(n/w)
per rank), so DCP records every chunk at its global offset: a checkpoint loads into any dp_shard
size, and an offline tool can read a unit's whole flat tensor. HSDP replicas save identical chunks,
which DCP deduplicates.
"""

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from parallel.fsdp.unit import FSDPUnit


def shard_as_dtensor(unit: FSDPUnit, local: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    """Wrap (without copying) this rank's unpadded shard of `local`, a tensor shaped like the shard."""
    valid = unit.spec.valid_in_shard(unit.rank)
    return DTensor.from_local(
        local.detach()[:valid], mesh, [Shard(0)], run_check=False, shape=torch.Size([unit.spec.total]), stride=(1,)
    )
