"""World -> (pp, dp_replicate, dp_shard, cp, tp) device mesh, its named groups, and validation.

tp varies fastest, then cp, dp_shard, dp_replicate, pp (Megatron order). FSDP shards over
dp_shard x cp (CP ranks hold identical weights) and, for HSDP, all-reduces over dp_replicate.
`ParallelDims` checks that the sizes multiply to the world size before any process group exists (the
model-dependent divisibility rules are the caller's, also before), so a bad layout fails with one line
instead of a hang.
"""

import gc
from datetime import timedelta
from functools import partial
from dataclasses import dataclass

import torch
import torch.distributed as dist
# Imported before any group exists: its functions take `group=group.WORLD` as a default argument, which
# an import after init_process_group (activation checkpointing, DCP and TE import it lazily) would pin
# to the live default group for the life of the process, past destroy_process_group.
import torch.distributed.nn.functional  # noqa: F401
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from parallel import comm
from parallel.attempt import agreed_attempt, launch_name
from parallel.errors import ConfigError
from parallel.launch_env import LaunchEnv

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
DEFAULT_TIMEOUT_S = 600.0  # the comm_timeout_s default


@dataclass(frozen=True)
class ParallelDims:
    world_size: int
    pp: int
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int

    @classmethod
    def from_sizes(
        cls,
        world_size: int,
        model_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        context_parallel_size: int = 1,
        dp_replicate: int = 1,
    ) -> "ParallelDims":
        """Derive dp_shard = world / (tp * pp * cp * dp_replicate); the names are the config keys."""
        sizes = {
            "model_parallel_size": model_parallel_size,
            "pipeline_parallel_size": pipeline_parallel_size,
            "context_parallel_size": context_parallel_size,
            "dp_replicate": dp_replicate,
        }
        for key, size in sizes.items():
            if not isinstance(size, int) or size < 1:
                raise ConfigError(f"{key}={size} must be a positive integer")
        product = model_parallel_size * pipeline_parallel_size * context_parallel_size * dp_replicate
        if world_size % product:
            terms = " x ".join(f"{k}={v}" for k, v in sizes.items())
            raise ConfigError(f"world size {world_size} is not divisible by {terms} = {product}")
        return cls(
            world_size=world_size,
            pp=pipeline_parallel_size,
            dp_replicate=dp_replicate,
            dp_shard=world_size // product,
            cp=context_parallel_size,
            tp=model_parallel_size,
        )

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def shape(self) -> tuple[int, ...]:
        return tuple(getattr(self, d) for d in MESH_DIMS)


class ParallelMesh:
    """The device mesh plus the flattened groups the framework uses, each registered by name."""

    def __init__(self, dims: ParallelDims, device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.dims, self.device_type, self.timeout_s = dims, device_type, timeout_s
        self._checkpoint_group: ProcessGroup | None = None
        self._embedding_group: ProcessGroup | None = None
        self._embedding_groups_made = False
        self._pp_channels: list[ProcessGroup] = []
        options = partial(group_options, device_type, timeout_s)  # fresh options per group
        self.mesh: DeviceMesh = init_device_mesh(device_type, dims.shape(), mesh_dim_names=MESH_DIMS,
                                                 backend_override={name: options() for name in MESH_DIMS})
        flat = {
            "dp": ("dp_replicate", "dp_shard"),
            "dp_shard_cp": ("dp_shard", "cp"),
            # The loss: summed over the data each rank saw, from the last stage (others add zero).
            "pp_dp_cp": ("pp", "dp_replicate", "dp_shard", "cp"),
            # fp8 amaxes: every rank of a pipeline stage (TransformerEngine's tp x cp x dp group).
            "dp_cp_tp": ("dp_replicate", "dp_shard", "cp", "tp"),
            # The gradient norm: every piece of every parameter lives on exactly one of these ranks.
            "pp_dp_shard_cp_tp": ("pp", "dp_shard", "cp", "tp"),
        }
        self._flat = {name: self.mesh[dims_]._flatten(name, backend_override=options()) for name, dims_ in flat.items()}
        # One group can carry several names (dp_shard_cp is dp_shard when cp=1, dp may be the world
        # group): the first name wins, mesh dimensions before "world".
        names: dict[ProcessGroup, str] = {}
        for name in (*MESH_DIMS, *self._flat):
            names.setdefault(self.group(name), name)
        names.setdefault(dist.group.WORLD, "world")
        comm.register_groups(names)

    def checkpoint_group(self) -> ProcessGroup:
        """Every rank, for asynchronous checkpoint writes: DCP runs their collectives in a background
        thread while training's run on the other groups, so they need a group of their own (gloo: DCP's
        async save needs a CPU backend). Created on first use, which is the same save on every rank."""
        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout_s))
            comm.register_groups({self._checkpoint_group: "checkpoint"})
        return self._checkpoint_group

    def embedding_group(self) -> ProcessGroup | None:
        """The first and the last pipeline rank of this rank's (dp, cp, tp) coordinates, which hold the
        copies of a weight tied across the pipeline (tied embeddings: Megatron's embedding group); None
        with one stage, and on the stages between. Made on first use, which must be the same call on every
        rank: every rank takes part in making each group."""
        if self.dims.pp == 1:
            return None
        if not self._embedding_groups_made:
            ranks = self.mesh.mesh  # global ranks, (pp, dp_replicate, dp_shard, cp, tp)
            pairs = torch.stack([ranks[0], ranks[-1]], dim=-1).reshape(-1, 2).tolist()
            backend, _ = group_options(self.device_type, self.timeout_s)
            mine, _ = dist.new_subgroups_by_enumeration(pairs, timeout=timedelta(seconds=self.timeout_s),
                                                        backend=backend)
            if mine is not None:
                comm.register_groups({mine: "embedding"})
            self._embedding_group, self._embedding_groups_made = mine, True
        return self._embedding_group

    def pipeline_channels(self, count: int) -> list[ProcessGroup]:
        """`count` communicators over this rank's pipeline ranks, group rank = pipeline rank: the pp group
        and count - 1 more, each named "pp" in the ledger (what they are for: pipeline/channels.py). Made
        on first use, which must be the same call on every rank."""
        while len(self._pp_channels) < count - 1:
            ranks = self.mesh.mesh.movedim(0, -1).reshape(-1, self.dims.pp).tolist()  # pp varies fastest
            backend, _ = group_options(self.device_type, self.timeout_s)
            mine, _ = dist.new_subgroups_by_enumeration(ranks, timeout=timedelta(seconds=self.timeout_s),
                                                        backend=backend)
            comm.register_groups({mine: "pp"})
            # Every rank makes the communicator here, together: NCCL's lazy creation at the first
            # send/recv would wait for ranks that reach their first transfer on this channel much later.
            comm.barrier(mine)
            self._pp_channels.append(mine)
        return [self.group("pp"), *self._pp_channels[:count - 1]]

    def group(self, name: str) -> ProcessGroup:
        if name in self._flat:
            return self._flat[name].get_group()
        return self.mesh.get_group(name)

    def rank_in(self, name: str) -> int:
        if name in self._flat:
            return self._flat[name].get_local_rank()
        return self.mesh.get_local_rank(name)

    @property
    def dp_rank(self) -> int:
        return self.rank_in("dp")


def init_process_group(launch: LaunchEnv, device: torch.device,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, str]:
    """gloo on CPU, NCCL on CUDA, every collective bounded by `timeout_s`; a lone process without
    torchrun gets an in-memory store. Returns how many attempts of this torchrun launch came before this
    one, and the launch's name (parallel/attempt.py), the same on every rank."""
    timeout = timedelta(seconds=timeout_s)
    comm.LEDGER.timeout_s = timeout_s
    if not launch.torchrun:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return 0, launch.run_id
    store, _, _ = next(dist.rendezvous("env://", rank=launch.rank, world_size=launch.world_size))
    number, restarts = agreed_attempt(store, launch.rank, launch.world_size, launch.restart_count, timeout_s)
    name = launch_name(store, restarts, launch.shared_store)
    # The attempt's own namespace of the store: the new group must not read the addresses a dead one
    # published (it would connect to dead peers and fail again).
    store = dist.PrefixStore(f"attempt_{number}/", store)
    if device.type == "cuda":
        dist.init_process_group("nccl", store=store, rank=launch.rank, world_size=launch.world_size, device_id=device,
                                timeout=timeout)
    else:
        dist.init_process_group("gloo", store=store, rank=launch.rank, world_size=launch.world_size, timeout=timeout)
    return restarts, name


def group_options(device_type: str, timeout_s: float) -> tuple[str, object]:
    """Backend and options of a subgroup: new groups do not inherit the default group's timeout."""
    if device_type == "cuda":
        backend, options = "nccl", dist.ProcessGroupNCCL.Options()
    else:
        backend, options = "gloo", dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    return backend, options


def shutdown_process_groups() -> None:
    """Free every reference to a process group (the ledger's names, FSDP units caught in hook
    reference cycles) before destroying them: a gloo group that outlives destroy_process_group is
    torn down at interpreter exit, where its threads can abort the process."""
    comm.forget_groups()
    gc.collect()
    dist.destroy_process_group()
