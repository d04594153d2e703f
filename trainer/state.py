"""What a checkpoint holds, as one DCP state dict: FSDP shards, optimizer state, step, RNG.

Weights and Adam moments are saved per FSDP unit as DTensors of the unit's flat length (see
parallel/fsdp/state_dict.py), so a checkpoint reloads into any data-parallel layout and an offline
tool can rebuild full weights. Everything is a tensor: loading never unpickles user data. The sampler
position needs no state (the global batch of step s is a pure function of seed, data and s), but
what fixes the data order is stored and checked, so a resume can never silently change the data.
"""

from pathlib import Path

import torch
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from model.transformer import Transformer
from parallel.fsdp import FSDPRoot
from parallel.fsdp.flat_param import FlatParamSpec, unflatten
from parallel.fsdp.state_dict import shard_as_dtensor
from parallel.random import RNGStreams
from parallel.tensor_parallel import TPContext, tp_merge
from trainer.checkpoint import checkpoint_keys, load_checkpoint
from trainer.config import TrainConfig
from trainer.optimizer import ADAM_STATE, NamedAdamW
from trainer.sampler import GlobalBatchSampler
from trainer.parallelize import fsdp_unit_names


def rng_key(rank: int, world: int, tp: int, pp: int) -> str:
    """RNG streams belong to a rank of one layout: another layout must not inherit them."""
    return f"rank{rank}_of_{world}_tp{tp}_pp{pp}"


def checkpoint_state(
    roots: list[FSDPRoot], optimizer: NamedAdamW, rng: RNGStreams, sampler: GlobalBatchSampler, mesh: DeviceMesh,
    step: int, rank: int, pp: int,
) -> dict:
    """Views of the live tensors: saving reads them, loading (dcp.load) writes into them in place.
    Units are keyed by their names in the whole model, so each pipeline stage saves and loads its own
    units and a checkpoint reloads under any pipeline layout."""
    units = {f"{u.name}.flat_param": u for root in roots for u in root.units}
    opt_state = optimizer.state()
    # fp8 scaling state: identical on every rank of a stage (plain tensors, which DCP saves once).
    fp8 = {f"{u.name}.{name}": buf for root in roots for u in root.units for name, buf in u.module.named_buffers()}
    return ({"fp8": fp8} if fp8 else {}) | {
        "model": {key: shard_as_dtensor(u, u.flat_param, mesh) for key, u in units.items()},
        "optim": {
            key: {"step": opt_state[key]["step"]}
            | {k: shard_as_dtensor(u, opt_state[key][k], mesh) for k in ADAM_STATE}
            for key, u in units.items()
        },
        "trainer": {"step": torch.tensor(step, dtype=torch.int64)}
        | {k: torch.tensor(v, dtype=torch.int64) for k, v in sampler.state_dict().items()},
        "rng": {rng_key(rank, torch.distributed.get_world_size(), roots[0].units[0].tp.size, pp): rng.state()},
    }


def load_into(
    path: Path, state: dict, rng: RNGStreams, sampler: GlobalBatchSampler, group: ProcessGroup
) -> int:
    """Load a checkpoint into `checkpoint_state` views; returns the step it was taken after."""
    (key,) = state["rng"]
    saved_keys = checkpoint_keys(path)
    if f"rng.{key}.shared" not in saved_keys:
        del state["rng"]  # another layout: this rank's streams were not saved, start them fresh
    if "fp8" in state and not any(k.startswith("fp8.") for k in saved_keys):
        del state["fp8"]  # fp8 switched on at this resume (resume.allow_changed): scaling starts fresh
    load_checkpoint(path, state, group)
    sampler.check_resumable({k: int(v) for k, v in state["trainer"].items()})
    if "rng" in state:
        rng.load_state(state["rng"][key])
    return int(state["trainer"]["step"])


def load_full_weights(path: Path, cfg: TrainConfig) -> dict[str, torch.Tensor]:
    """Full fp32 weights {parameter name: tensor} from a checkpoint, in one process (export, tools).

    Each unit's [tp, flat] tensor is unflattened per TP rank (with that rank's local shapes) and the
    TP slices are merged (part by part for fused parameters); TP-replicated ones come from rank 0.
    """
    tp_size = cfg.model_parallel_size
    with torch.device("meta"):
        ranks = [Transformer(cfg.model_args(), TPContext(size=tp_size, rank=r)) for r in range(tp_size)]
    names = fsdp_unit_names(ranks[0])
    specs = {name: [FlatParamSpec.of_module(m.get_submodule(name), world=1) for m in ranks] for name in names}
    state = {"model": {f"{name}.flat_param": torch.empty(tp_size, s[0].total) for name, s in specs.items()}}
    load_checkpoint(path, state, group=None)
    weights = {}
    for name in names:
        flat = state["model"][f"{name}.flat_param"]
        slices = [unflatten(flat[r], specs[name][r]) for r in range(tp_size)]
        for param_name, param in ranks[0].get_submodule(name).named_parameters():
            weights[f"{name}.{param_name}"] = tp_merge([rank_slices[param_name] for rank_slices in slices], param)
    return weights
