"""What a checkpoint holds, as one DCP state dict: weights, optimizer state, step, RNG.

Weights and Adam moments are saved per parameter under its full name and at its full shape, each rank
writing the boxes its FSDP shard holds (see parallel/fsdp/state_dict.py), so a checkpoint reloads
into any layout (tp, pp, vpp, dp, cp) and an offline tool reads full weights directly. Everything is a tensor: loading never unpickles user data. The sampler
position needs no state (the global batch of step s is a pure function of seed, data and s), but
what fixes the data order is stored and checked, so a resume can never silently change the data.
"""

from pathlib import Path

import torch
from torch.distributed import ProcessGroup

from model.transformer import Transformer
from parallel.fsdp import FSDPRoot
from parallel.fsdp.state_dict import BoxedParameter, boxed_parameters
from parallel.fsdp.tied import aliases
from parallel.fsdp.unit import FSDPUnit
from parallel.mesh import ParallelDims
from parallel.random import RNGStreams
from parallel.tensor_parallel import TPContext
from trainer.checkpoint.files import CheckpointError, checkpoint_keys, load_checkpoint
from trainer.config.schema import TrainConfig
from trainer.data.sampler import GlobalBatchSampler
from trainer.optimizer import ADAM_STATE, NamedAdamW

# Data-order versions newer than some checkpoints: one written before a version was stored made that
# version's first kind, which this trainer cannot rebuild.
_DATA_ORDER_VERSIONS = {
    "shuffle_version": "shuffled the data another way (shuffle_version 1)",
    "split_version": "held out the last fraction of seq_len windows, not of tokens (split_version 1), so it "
                     "trained on another number of sequences",
}


def rng_key(rank: int, layout: ParallelDims, device: torch.device) -> str:
    """RNG streams belong to a rank of one layout on one kind of device (a CUDA generator's state is not
    a CPU one's): another must not inherit them."""
    on = "" if device.type == "cpu" else f"_{device.type}"  # CPU checkpoints keep the key they always had
    return (f"rank{rank}_of_{layout.world_size}_tp{layout.tp}_pp{layout.pp}_cp{layout.cp}"
            f"_dpr{layout.dp_replicate}{on}")


def _boxed(unit: FSDPUnit, local: torch.Tensor) -> dict[str, BoxedParameter]:
    return boxed_parameters(unit.name, unit.spec, unit.tp_splits, unit.rank, unit.tp.rank, unit.tp.size, local,
                            aliases(unit))


def checkpoint_state(
    roots: list[FSDPRoot], optimizer: NamedAdamW, rng: RNGStreams, sampler: GlobalBatchSampler, step: int,
    rank: int, layout: ParallelDims,
) -> dict:
    """Views of the live tensors: saving reads them, loading (dcp.load) writes into them in place.
    Parameters and units are keyed by their names in the whole model, so each pipeline stage saves and
    loads its own and a checkpoint reloads under any pipeline layout."""
    units = [u for root in roots for u in root.units]
    opt_state = optimizer.state()
    # fp8 scaling state: identical on every rank (plain tensors, which DCP saves once). The in-tree fp8
    # keeps it in buffers; a block whose library keeps it elsewhere (TE) hands it over as scaling_state().
    fp8 = {f"{u.name}.{name}": buf for u in units for name, buf in u.module.named_buffers()}
    fp8 |= {f"{u.name}.{name}": t for u in units if hasattr(u.module, "scaling_state")
            for name, t in u.module.scaling_state().items()}
    moments = {}
    for u in units:
        for k in ADAM_STATE:
            moments |= {f"{param}.{k}": v for param, v in _boxed(u, opt_state[f"{u.name}.flat_param"][k]).items()}
    return ({"fp8": fp8} if fp8 else {}) | {
        "model": {param: v for u in units for param, v in _boxed(u, u.flat_param).items()},
        "optim": moments | {f"{u.name}.step": opt_state[f"{u.name}.flat_param"]["step"] for u in units},
        "trainer": {"step": torch.tensor(step, dtype=torch.int64)}
        | {k: torch.tensor(v, dtype=torch.int64) for k, v in sampler.state_dict().items()},
        "rng": {rng_key(rank, layout, rng.device): rng.state()},
    }


def load_into(
    path: Path, state: dict, rng: RNGStreams, sampler: GlobalBatchSampler, group: ProcessGroup
) -> int:
    """Load a checkpoint into `checkpoint_state` views; returns the step it was taken after."""
    (key,) = state["rng"]
    saved_keys = checkpoint_keys(path)
    if any(k.endswith(".flat_param") for k in saved_keys):
        raise CheckpointError(f"checkpoint {path} stores flat FSDP shards, a format older than this trainer's "
                              "(full named parameters); it cannot be resumed by this version")
    if f"rng.{key}.shared" not in saved_keys:
        del state["rng"]  # another layout: this rank's streams were not saved, start them fresh
    if "fp8" in state and not any(k.startswith("fp8.") for k in saved_keys):
        del state["fp8"]  # fp8 switched on at this resume (resume.allow_changed): scaling starts fresh
    missing = [k for k in state["trainer"] if f"trainer.{k}" not in saved_keys]
    for version, what in _DATA_ORDER_VERSIONS.items():
        if version in missing:
            raise CheckpointError(f"checkpoint {path} was written by a trainer version that {what}; resuming would "
                                  "change the data order: finish the run with that version, or start it over in a "
                                  "new dump_dir")
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks trainer.{missing[0]}: another trainer version wrote it, and "
                              "this one cannot resume it")
    flags_to_set = _scale_flags_older_checkpoints_lack(state, saved_keys)
    missing = [name for name in state.get("fp8", {}) if f"fp8.{name}" not in saved_keys]
    if missing:
        raise CheckpointError(f"checkpoint {path} has fp8 scaling state, but not this model's ({missing[0]}): it was "
                              "saved with the other fp8 implementation (model.use_te_layers); resume with the "
                              "model.use_te_layers of the run that saved it")
    load_checkpoint(path, state, group)
    for flag in flags_to_set:
        flag.fill_(True)
    sampler.check_resumable({k: int(v) for k, v in state["trainer"].items()})
    if "rng" in state:
        rng.load_state(state["rng"][key])
    return int(state["trainer"]["step"])


def _scale_flags_older_checkpoints_lack(state: dict, saved_keys: set[str]) -> list[torch.Tensor]:
    """In-tree fp8 state saved before `scale_is_set` existed: every saved scale was in use, so the
    flags are taken out of the load and set afterwards (the run continues as it would have)."""
    fp8 = state.get("fp8", {})
    absent = [name for name in fp8 if name.endswith(".scale_is_set") and f"fp8.{name}" not in saved_keys
              and f"fp8.{name.removesuffix('_is_set')}" in saved_keys]
    return [fp8.pop(name) for name in absent]


def load_full_weights(path: Path, cfg: TrainConfig, names: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Full fp32 weights {parameter name: tensor} from a checkpoint, in one process (export, tools):
    every parameter, or only `names` (DCP then reads only their bytes)."""
    with torch.device("meta"):
        model = Transformer(cfg.model, TPContext(size=1, rank=0))
    params = dict(model.named_parameters())
    wanted = params if names is None else {name: params[name] for name in names}
    state = {"model": {name: torch.empty(p.shape) for name, p in wanted.items()}}
    load_checkpoint(path, state, group=None)
    return state["model"]
