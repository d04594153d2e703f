"""Layout-independent initialization.

Every parameter draws its FULL (unsharded) value from a generator seeded by (seed, parameter name),
so the same seed yields the same full weights whatever the tp/pp/cp/dp layout and whatever order the
modules are built in; a rank that holds a shard keeps its slice of that full tensor.
"""

import math
import zlib

import torch
from torch import nn

from model.args import ModelArgs
from parallel.tensor_parallel import TPContext, tp_local_slice

_OUTPUT_PROJECTIONS = ("attention.wo.weight", "feed_forward.w2.weight")


def init_std(name: str, args: ModelArgs) -> float | None:
    """Std of a parameter's normal init; None for norm weights (ones)."""
    if name.endswith("norm.weight"):
        return None
    if name == "tok_embeddings.weight":
        return 1.0
    if name == "head.output.weight":
        return args.dim**-0.5
    if name.endswith(_OUTPUT_PROJECTIONS):
        return 0.02 / math.sqrt(2 * args.n_layers)
    return 0.02


def full_init_value(name: str, shape: torch.Size, args: ModelArgs, seed: int) -> torch.Tensor:
    """The full fp32 initial value of parameter `name`, identical on every rank and layout."""
    std = init_std(name, args)
    if std is None:
        return torch.ones(shape)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    value = torch.empty(shape)
    nn.init.trunc_normal_(value, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=gen)
    return value


def full_shape(param: torch.Tensor, tp: TPContext) -> torch.Size:
    """The unsharded shape of a (possibly TP-sharded) parameter."""
    dim = getattr(param, "tp_dim", None)
    if dim is None:
        return param.shape
    shape = list(param.shape)
    shape[dim] *= tp.size
    return torch.Size(shape)


def local_init_value(name: str, param: torch.Tensor, args: ModelArgs, seed: int, tp: TPContext) -> torch.Tensor:
    """This TP rank's slice of the full initial value; `param` may live on the meta device."""
    return tp_local_slice(full_init_value(name, full_shape(param, tp), args, seed), param, tp)


@torch.no_grad()
def init_weights(model: nn.Module, args: ModelArgs, seed: int, tp: TPContext | None = None) -> None:
    """Each rank draws the full value and keeps its TP slice of it."""
    tp = tp or TPContext()
    for name, param in model.named_parameters():
        param.copy_(local_init_value(name, param, args, seed, tp))
