"""Layout-independent initialization that draws only what a rank keeps.

A parameter's full value is cut into fixed tiles (TILE x TILE for matrices, TILE * TILE elements for
vectors); each tile is drawn from its own generator, seeded by (seed, parameter name, tile index).
So the same seed yields the same full weights whatever the tp/pp/cp/dp layout and build order, and a
rank materializes its TP slice by drawing just the tiles that slice overlaps: within one tile per edge
of what it keeps, never the whole (unsliced) parameter; under FSDP a rank draws only the boxes of its
shard (`init_box`), about 1/(tp x dp) of the model. Values are drawn on the CPU (one generator
everywhere, so CPU and CUDA runs start from the same weights) and moved to the device by the caller.

A padded vocabulary (args.valid_vocab_size below args.vocab_size) starts its padding rows of the
embedding and the head at zero, and draws its other rows from tiles cut at the tokenizer's size, as the
unpadded model does: padding changes no real weight.
"""

import hashlib
import math
from dataclasses import dataclass

import torch
from torch import nn

from model.args import ModelArgs
from model.fp8 import initial_buffer
from model.transformer import TIED_COPY, TIED_WEIGHT, VOCAB_PARAMETERS, weight_name
from parallel.tensor_parallel import TPContext

_OUTPUT_PROJECTIONS = ("attention.wo.weight", "feed_forward.w2.weight")
TILE = 128


def init_std(name: str, args: ModelArgs) -> float | None:
    """Std of a parameter's normal init; None for norm weights (ones)."""
    if name.endswith("norm.weight"):
        return None
    if name == TIED_WEIGHT:
        # Tied, it is also the output projection: the head's std, so that logits start as the untied head's do
        # (std 1 would scale them by sqrt(dim)).
        return args.dim**-0.5 if args.tie_embeddings else 1.0
    if name == TIED_COPY:  # the untied head's projection (a tied copy is drawn as TIED_WEIGHT: init_region)
        return args.dim**-0.5
    if name.endswith(_OUTPUT_PROJECTIONS):
        return 0.02 / math.sqrt(2 * args.n_layers)
    return 0.02


def _tile_shape(shape: torch.Size) -> tuple[int, ...]:
    return (TILE * TILE,) if len(shape) == 1 else (TILE,) * 2 + tuple(shape[2:])


def tile_seed(seed: int, name: str, index: tuple[int, ...]) -> int:
    """The generator seed of one tile: a 63-bit hash of (seed, name, index), so no two tiles of any
    parameters or seeds share a stream. (A 32-bit CRC of name and index, offset by the seed, gave
    thousands of llama3_70b tiles exact copies of others, and seed sweeps shared tiles.)"""
    digest = hashlib.blake2b(f"{seed}|{name}@{','.join(map(str, index))}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _draw_tile(name: str, index: tuple[int, ...], shape: tuple[int, ...], std: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tile_seed(seed, name, index))
    # Normal within +-3 std: rejection redraws the 0.27% outside (4x faster than trunc_normal_'s
    # inverse-CDF passes, the same distribution).
    value = torch.empty(shape).normal_(0.0, std, generator=gen)
    outside = value.abs() > 3 * std
    while outside.any():
        value[outside] = torch.empty(int(outside.sum())).normal_(0.0, std, generator=gen)
        outside = value.abs() > 3 * std
    return value


def init_region(name: str, shape: torch.Size, region: tuple[slice, ...], args: ModelArgs, seed: int) -> torch.Tensor:
    """full_value[region] of parameter `name` (full shape `shape`; `region` slices its first one or two
    dims), drawing only the tiles the region overlaps. The tied head's copy draws the embedding's values;
    a padded vocabulary's rows past the tokenizer's are zero."""
    name = weight_name(name, args)
    real = _real_rows(name, shape, args)
    if real is not None:
        return _padded_region(name, shape, region, real, args, seed)
    std = init_std(name, args)
    sizes = [s.stop - s.start for s in region] + list(shape[len(region):])
    if std is None:
        return torch.ones(sizes)
    tile = _tile_shape(shape)
    out = torch.empty(sizes)
    tiled_dims = min(len(shape), 2)
    ranges = [range(region[d].start // tile[d], -(-region[d].stop // tile[d])) for d in range(tiled_dims)]
    for index in _product(ranges):
        lo = [i * tile[d] for d, i in enumerate(index)]
        hi = [min(lo[d] + tile[d], shape[d]) for d in range(tiled_dims)]
        drawn = _draw_tile(name, index, tuple(h - l for l, h in zip(lo, hi)) + tuple(shape[2:]), std, seed)
        src = tuple(slice(max(region[d].start, lo[d]) - lo[d], min(region[d].stop, hi[d]) - lo[d])
                    for d in range(tiled_dims))
        dst = tuple(slice(max(region[d].start, lo[d]) - region[d].start, min(region[d].stop, hi[d]) - region[d].start)
                    for d in range(tiled_dims))
        out[dst] = drawn[src]
    return out


def _real_rows(name: str, shape: torch.Size, args: ModelArgs) -> int | None:
    """The rows of a vocabulary parameter that are the tokenizer's, where padding follows them; else None."""
    valid = args.valid_vocab_size
    if name not in VOCAB_PARAMETERS or valid is None or valid >= shape[0]:
        return None
    return valid


def _padded_region(name: str, shape: torch.Size, region: tuple[slice, ...], real: int, args: ModelArgs,
                   seed: int) -> torch.Tensor:
    """A region of a padded vocabulary parameter: zero from row `real` on, the rows before it the unpadded
    parameter's (of `real` rows: its last tiles are cut where the unpadded model's are)."""
    rows = region[0]
    out = torch.zeros([s.stop - s.start for s in region] + list(shape[len(region):]))
    kept = slice(rows.start, min(rows.stop, real))
    if kept.start < kept.stop:  # a TP rank or FSDP shard may hold padding only
        unpadded = torch.Size((real, *shape[1:]))
        out[: kept.stop - kept.start] = init_region(name, unpadded, (kept, *region[1:]), args, seed)
    return out


def init_box(name: str, shape: tuple[int, ...], offsets: tuple[int, ...], sizes: tuple[int, ...], args: ModelArgs,
             seed: int) -> torch.Tensor:
    """The box [offsets, offsets + sizes) of parameter `name`'s full initial value (full shape `shape`)."""
    if any(o or s != n for o, s, n in zip(offsets[2:], sizes[2:], shape[2:])):
        raise ValueError(f"{name}: boxes must span every dim after the first two, got {offsets} + {sizes}")
    region = tuple(slice(o, o + s) for o, s in zip(offsets[:2], sizes[:2]))
    return init_region(name, torch.Size(shape), region, args, seed)


def _product(ranges: list[range]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for r in ranges:
        out = [(*prefix, i) for prefix in out for i in r]
    return out


def full_init_value(name: str, shape: torch.Size, args: ModelArgs, seed: int) -> torch.Tensor:
    """The full fp32 initial value of parameter `name`, identical on every rank and layout."""
    return init_region(name, shape, _whole(shape), args, seed)


def _whole(shape: torch.Size) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape[:2])


def full_shape(param: torch.Tensor, tp: TPContext) -> torch.Size:
    """The unsharded shape of a (possibly TP-sharded) parameter."""
    dim = getattr(param, "tp_dim", None)
    if dim is None:
        return param.shape
    shape = list(param.shape)
    shape[dim] *= tp.size
    return torch.Size(shape)


def local_regions(param: torch.Tensor, shape: torch.Size, tp: TPContext) -> list[tuple[slice, ...]]:
    """The regions of the full value that make up this TP rank's slice, in order (one per fused part)."""
    dim = getattr(param, "tp_dim", None)
    if dim is None or tp.size == 1:
        return [_whole(shape)]
    parts = getattr(param, "tp_parts", None) or (shape[dim],)
    regions, start = [], 0
    for part in parts:
        local = part // tp.size
        region = list(_whole(shape))
        region[dim] = slice(start + tp.rank * local, start + (tp.rank + 1) * local)
        regions.append(tuple(region))
        start += part
    return regions


def local_init_value(name: str, param: torch.Tensor, args: ModelArgs, seed: int, tp: TPContext) -> torch.Tensor:
    """This TP rank's slice of the full initial value; `param` may live on the meta device."""
    shape = full_shape(param, tp)
    dim = getattr(param, "tp_dim", None) or 0
    return torch.cat([init_region(name, shape, r, args, seed) for r in local_regions(param, shape, tp)], dim)


@torch.no_grad()
def init_weights(model: nn.Module, args: ModelArgs, seed: int, tp: TPContext | None = None) -> None:
    """Each rank draws the tiles of its TP slices."""
    tp = tp or TPContext()
    for name, param in model.named_parameters():
        param.copy_(local_init_value(name, param, args, seed, tp))


@dataclass(frozen=True)
class ModelInitializer:
    """The initial values of a model built on the meta device, as FSDP asks for them unit by unit
    (parallel.fsdp.Initializer): parameter boxes drawn tile by tile, buffers at their starting values."""

    args: ModelArgs
    seed: int
    device: torch.device

    def parameter_box(self, name: str, full_shape: tuple[int, ...], offsets: tuple[int, ...],
                      sizes: tuple[int, ...]) -> torch.Tensor:
        return init_box(name, full_shape, offsets, sizes, self.args, self.seed).to(self.device)

    def buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        return initial_buffer(name, like).to(self.device)
