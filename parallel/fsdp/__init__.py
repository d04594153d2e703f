"""In-tree FSDP: flat parameters per unit, a microbatch protocol, ZeRO-2/3 and HSDP."""

from parallel.fsdp.norms import grad_norm, unit_norms
from parallel.fsdp.root import FSDPRoot, fully_shard
from parallel.fsdp.tied import TiedCopy, sum_tied_grads, tied_copies_equal
from parallel.fsdp.unit import CONCAT_EVENT, FSDPConfig, FSDPUnit, TPGroups, UnitState

__all__ = ["CONCAT_EVENT", "FSDPConfig", "FSDPRoot", "FSDPUnit", "TPGroups", "TiedCopy", "UnitState", "fully_shard",
           "grad_norm", "sum_tied_grads", "tied_copies_equal", "unit_norms"]
