"""Checkpoint boxes: every rank's shard maps onto the full parameters exactly once, for any layout, and
a checkpoint saved under one layout loads into the shards of another."""

import itertools

import pytest
import torch
from torch import nn

from parallel.fsdp.flat_param import FlatParamSpec, flatten, shard_of
from parallel.fsdp.state_dict import TPSplit, boxed_parameters, flat_range_boxes, shard_boxes
from parallel.tensor_parallel import TPContext, mark_tp_dim, tp_local_slice
from trainer.checkpoint.files import load_checkpoint, save_checkpoint

# name: (full shape, TP split): fused q/k/v rows, a row-parallel weight, a norm, a vocab-split embedding.
PARAMS = {
    "wqkv": ((32, 6), TPSplit(0, (16, 8, 8))),
    "wo": ((5, 8), TPSplit(1)),
    "norm": ((7,), TPSplit(None)),
    "emb": ((12, 3), TPSplit(0)),
}


def full_values(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) for name, (shape, _) in PARAMS.items()}


def local_shards(full: dict[str, torch.Tensor], tp: int, tp_rank: int, world: int):
    """This TP rank's flat spec and every shard rank's shard, cut the way FSDP cuts them."""
    params = [mark_tp_dim(nn.Parameter(full[n]), s.dim, s.parts) for n, (_, s) in PARAMS.items()]
    ctx = TPContext(size=tp, rank=tp_rank)
    local = [tp_local_slice(full[n], p, ctx) for n, p in zip(PARAMS, params)]
    spec = FlatParamSpec(tuple(PARAMS), tuple(t.shape for t in local), world)
    flat = flatten(local, spec)
    return spec, [shard_of(flat, spec, r) for r in range(world)]


def test_flat_ranges_split_into_contiguous_boxes():
    shape = (3, 4, 5)
    for lo, hi in itertools.combinations(range(61), 2):
        covered = torch.zeros(shape, dtype=torch.int64)
        position = lo
        for offsets, sizes in flat_range_boxes(shape, lo, hi):
            index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
            expected = torch.arange(60).view(shape)[index].reshape(-1)
            assert torch.equal(expected, torch.arange(position, position + expected.numel()))  # contiguous, in order
            position += expected.numel()
            covered[index] += 1
        assert torch.equal(covered.view(-1), ((torch.arange(60) >= lo) & (torch.arange(60) < hi)).long())


@pytest.mark.parametrize("tp,world", [(1, 1), (2, 1), (2, 3), (4, 2), (1, 5)])
def test_boxes_cover_every_full_parameter_exactly_once(tp, world):
    full = full_values()
    rebuilt = {n: torch.zeros(s) for n, (s, _) in PARAMS.items()}
    written = {n: torch.zeros(s, dtype=torch.int64) for n, (s, _) in PARAMS.items()}
    splits = tuple(s for _, s in PARAMS.values())
    for tp_rank in range(tp):
        spec, shards = local_shards(full, tp, tp_rank, world)
        for shard_rank, shard in enumerate(shards):
            for name, boxed in boxed_parameters("unit", spec, splits, shard_rank, tp_rank, tp, shard).items():
                param = name.removeprefix("unit.")
                assert tuple(boxed.shape) == PARAMS[param][0]
                for offsets, view in boxed._views.items():
                    index = tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))
                    assert torch.equal(view, full[param][index]), (param, offsets)
                    if boxed._writes:
                        rebuilt[param][index] = view
                        written[param][index] += 1
    for name in PARAMS:
        assert torch.equal(written[name], torch.ones_like(written[name])), name
        assert torch.equal(rebuilt[name], full[name])


def test_boxes_of_a_shard_without_padding_or_parameters():
    spec = FlatParamSpec(("a",), (torch.Size([3]),), world=4)  # shard size 1: rank 3 holds only padding
    assert shard_boxes(spec, 3, (TPSplit(),), 0, 1) == {}


def test_a_checkpoint_of_one_layout_loads_into_the_shards_of_another(tmp_path, world):
    full = full_values(seed=1)
    splits = tuple(s for _, s in PARAMS.values())
    spec, (shard,) = local_shards(full, 1, 0, 1)
    save_checkpoint(tmp_path, 1, {"model": boxed_parameters("u", spec, splits, 0, 0, 1, shard)}, world, 0, {})
    for tp, n_shards in [(2, 3), (4, 2)]:
        for tp_rank, shard_rank in itertools.product(range(tp), range(n_shards)):
            spec, shards = local_shards(full, tp, tp_rank, n_shards)
            target = torch.full_like(shards[shard_rank], float("nan"))
            load_checkpoint(tmp_path / "step_1", {"model": boxed_parameters(
                "u", spec, splits, shard_rank, tp_rank, tp, target)}, world)
            valid = spec.valid_in_shard(shard_rank)
            assert torch.equal(target[:valid], shards[shard_rank][:valid]), (tp, tp_rank, shard_rank)
