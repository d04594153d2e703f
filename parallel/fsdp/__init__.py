"""In-tree FSDP: flat parameters per unit, a microbatch protocol, ZeRO-2/3 and HSDP."""

from parallel.fsdp.root import FSDPRoot, fully_shard, grad_norm
from parallel.fsdp.unit import FSDPConfig, FSDPUnit, TPGroups, UnitState

__all__ = ["FSDPConfig", "FSDPRoot", "FSDPUnit", "TPGroups", "UnitState", "fully_shard", "grad_norm"]
