"""The configurations scripts/bench/fsdp.py compares, and how each runs one optimizer step: ours
(the in-tree FSDP with the trainer's AdamW over its flat shards), PyTorch FSDP2 and DDP (torch's AdamW,
foreach), the no-communication limit, and ours' collectives without compute. FSDP2's collectives are
counted by wrapping the torch.distributed functions it calls (see fsdp.py's docstring)."""

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from functools import wraps
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.nn.parallel import DistributedDataParallel

from model.args import ModelArgs
from model.init import init_weights
from model.transformer import Transformer
from parallel import comm
from parallel.fsdp import FSDPConfig, fully_shard
from parallel.mesh import ParallelMesh
from trainer.config.schema import OptimConfig
from trainer.optimizer import NamedAdamW

SEED = 0
ADAMW = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
TORCH_LEDGER = comm.CommLedger()  # FSDP2's collectives, counted by the wrappers below


@dataclass(frozen=True)
class Config:
    kind: str  # "ours" | "fsdp2" | "ddp" | "limit" | "comm"
    reshard: bool = False
    grad_reduce: str = "last_microbatch"  # ours only
    in_flight: int = 2  # ours only: gradient reductions overlapping the backward

    @property
    def label(self) -> str:
        if self.kind in ("ddp", "limit"):
            return self.kind
        if self.kind == "comm":
            return "comm alone (ours reshard=True's collectives, no compute)"
        extra = (", sync reductions" if self.in_flight == 0 else "") + \
            (", per_microbatch" if self.grad_reduce != "last_microbatch" else "")
        return f"{self.kind} reshard={self.reshard}{extra}"



# --- counting FSDP2's collectives ---------------------------------------------------------------
def _counted(op: str, fn: Callable, position: int, keyword: str) -> Callable:
    """Wrap a torch.distributed collective to record the bytes of its argument `position`/`keyword`."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = args[position] if len(args) > position else kwargs[keyword]
        TORCH_LEDGER.record(op, kwargs.get("group"), t.numel() * t.element_size())
        return fn(*args, **kwargs)

    return wrapper


def count_torch_collectives() -> None:
    """Wrap the names FSDP2 calls (torch 2.13 renamed them). parallel.comm bound the originals at import,
    so our FSDP's calls are not counted twice."""
    gather = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    scatter = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
    setattr(dist, gather, _counted("all_gather", getattr(dist, gather), 0, "output_tensor"))
    setattr(dist, scatter, _counted("reduce_scatter", getattr(dist, scatter), 1, "input"))


# --- one configuration: model, optimizer, microbatch protocol -------------------------------------
class Runner:
    """Runs one optimizer step of M microbatches; subclasses supply the FSDP/DDP protocol."""

    def __init__(self, model: nn.Module, loss_divisor: int):
        self.model, self.loss_divisor = model, loss_divisor
        self.optimizer = torch.optim.AdamW(model.parameters(), foreach=True, **ADAMW)
        self.forward_backward_s = 0.0  # of the last step

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def comm_wait_s(self) -> float | None:
        return None

    def microbatch(self, is_first: bool, is_last: bool) -> AbstractContextManager:
        return nullcontext()

    def finish_backward(self) -> None:
        pass

    def reset_comm(self) -> None:
        TORCH_LEDGER.reset()

    def comm(self) -> dict[str, dict[str, int]]:
        """{op: {count, bytes}} of the step just run."""
        return TORCH_LEDGER.by_op()

    def step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        """Returns this rank's summed token loss."""
        total, start = 0.0, time.perf_counter()
        for i, (x, y) in enumerate(microbatches):
            with self.microbatch(i == 0, i == len(microbatches) - 1):
                loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten(), reduction="sum")
                (loss / self.loss_divisor).backward()
            total += loss.item()
        self.finish_backward()
        self.forward_backward_s = time.perf_counter() - start
        self.optimizer_step()
        return total


class Ours(Runner):
    def __init__(self, model: Transformer, mesh: ParallelMesh, config: Config, global_tokens: int):
        cfg = FSDPConfig(reshard_after_forward=config.reshard, optimize_backward_concat=True,
                         grad_reduce=config.grad_reduce, reductions_in_flight=config.in_flight)
        self.root = fully_shard(model, unit_names(model), mesh.group("dp_shard_cp"), mesh.group("dp_replicate"), cfg)
        self.model, self.loss_divisor, self.forward_backward_s = model, global_tokens, 0.0  # sums over ranks
        self.optimizer = NamedAdamW([model], OptimConfig(lr=ADAMW["lr"], beta1=ADAMW["betas"][0],
                                    beta2=ADAMW["betas"][1], eps=ADAMW["eps"], weight_decay=ADAMW["weight_decay"]))

    def optimizer_step(self) -> None:
        self.optimizer.step(ADAMW["lr"])
        self.optimizer.zero_grad()

    def comm_wait_s(self) -> float:
        return comm.LEDGER.wait_s

    def microbatch(self, is_first: bool, is_last: bool) -> AbstractContextManager:
        self.root.set_microbatch(is_first, is_last)
        return nullcontext()

    def finish_backward(self) -> None:
        self.root.finish_gradient_sync()

    def reset_comm(self) -> None:
        comm.LEDGER.reset()

    def comm(self) -> dict[str, dict[str, int]]:
        return comm.LEDGER.by_op()


class CommAlone(Ours):
    """Ours with reshard=True minus the compute: per microbatch each unit gathered for its forward and
    again for its backward, then one reduce-scatter per unit, same sizes and order. What the transport
    costs on its own here: with no idle core it adds to the compute instead of hiding behind it."""

    def step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
        start, units = time.perf_counter(), self.root.units
        for _ in microbatches:
            for unit in [*units, *reversed(units)]:
                unit.unshard()
                unit.reshard()
        for unit in reversed(units):
            shard = torch.empty(unit.spec.shard_size)
            comm.reduce_scatter_tensor(shard, torch.zeros(unit.spec.padded), unit.shard_group, label=unit.name,
                                       consume_input=True)
        self.forward_backward_s = time.perf_counter() - start
        return 0.0


class FSDP2(Runner):
    def __init__(self, model: Transformer, reshard: bool, rank_tokens: int):
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for name in unit_names(model):
            fsdp2_fully_shard(model.get_submodule(name), mesh=mesh, reshard_after_forward=reshard)
        fsdp2_fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        self.reshard = reshard
        super().__init__(model, rank_tokens)  # FSDP2 averages gradients over ranks

    def microbatch(self, is_first: bool, is_last: bool) -> AbstractContextManager:
        self.model.set_requires_gradient_sync(is_last)
        if not self.reshard:
            self.model.set_reshard_after_backward(is_last)
        return nullcontext()


class DDP(Runner):
    def __init__(self, model: Transformer, rank_tokens: int):
        super().__init__(DistributedDataParallel(model), rank_tokens)  # DDP averages gradients over ranks

    def microbatch(self, is_first: bool, is_last: bool) -> AbstractContextManager:
        return nullcontext() if is_last else self.model.no_sync()

    def comm(self) -> dict[str, dict[str, int]]:
        """One all-reduce per gradient bucket, as laid out by DDP's reducer (rebuilt after its first step)."""
        data = self.model._get_ddp_logging_data()
        buckets = [int(b) for b in data.get("rebuilt_bucket_sizes", data["bucket_sizes"]).split(",")]
        return {"all_reduce": {"count": len(buckets), "bytes": sum(buckets)}}


def unit_names(model: Transformer) -> list[str]:
    return ["tok_embeddings", *(f"layers.{i}" for i in model.layers), "head"]


def build(cfg: Config, args: ModelArgs, microbatches: int, mesh: ParallelMesh) -> Runner:
    model = Transformer(args)
    init_weights(model, args, SEED)
    rank_tokens = microbatches * args.max_seq_len
    if cfg.kind in ("ours", "comm"):
        runner = Ours if cfg.kind == "ours" else CommAlone
        return runner(model, mesh, cfg, rank_tokens * dist.get_world_size())
    if cfg.kind == "fsdp2":
        return FSDP2(model, cfg.reshard, rank_tokens)
    if cfg.kind == "limit":
        return Runner(model, rank_tokens)
    return DDP(model, rank_tokens)
