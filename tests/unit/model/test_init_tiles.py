"""Initialization draws per tile: every layout reassembles the same full weights, bitwise, a shard built
from its boxes alone equals the shard of the TP-local values, a padded vocabulary starts its padding at
zero and its other weights as the unpadded model's, and a rank of a large model draws about its own
share (TP slice and FSDP shard), never the unsliced parameters."""

import dataclasses
import time

import torch
from omegaconf import OmegaConf

import model.init as init
from model.args import ModelArgs
from model.transformer import VOCAB_PARAMETERS, Transformer
from parallel.fsdp.flat_param import FlatParamSpec, flatten, shard_of
from parallel.fsdp.state_dict import TPSplit, boxed_parameters, fill_shard
from parallel.tensor_parallel import TPContext
from tests.e2e.launch import REPO
from trainer.config.schema import from_dict
from trainer.parallelize import fsdp_unit_names

# Big enough that TP slices cut through tiles (wqkv parts 256/128/128 over tp=4: 64-row slices).
ARGS = ModelArgs(n_layers=1, dim=256, n_heads=4, n_kv_heads=2, vocab_size=640, multiple_of=64, max_seq_len=8)


def reassembled(tp: int, dp: int, args: ModelArgs = ARGS) -> dict[str, torch.Tensor]:
    """Full weights rebuilt from every (TP rank, shard rank)'s initialized flat shard."""
    full: dict[str, torch.Tensor] = {}
    for tp_rank in range(tp):
        ctx = TPContext(size=tp, rank=tp_rank)
        with torch.device("meta"):
            model = Transformer(args, ctx)
        for unit in fsdp_unit_names(model):
            module = model.get_submodule(unit)
            named = list(module.named_parameters())
            spec = FlatParamSpec.of_module(module, dp)
            values = [init.local_init_value(f"{unit}.{n}", p, args, 9, ctx) for n, p in named]
            splits = tuple(TPSplit(getattr(p, "tp_dim", None), getattr(p, "tp_parts", None)) for _, p in named)
            flat = flatten(values, spec)
            for shard_rank in range(dp):
                shard = shard_of(flat, spec, shard_rank)
                drawn_alone = fill_shard(torch.zeros(spec.shard_size), spec, shard_rank, splits, tp_rank, tp,
                                         lambda n, *box: init.init_box(f"{unit}.{n}", *box, args, 9))
                assert torch.equal(drawn_alone, shard), (tp, dp, unit, shard_rank)
                for name, boxed in boxed_parameters(unit, spec, splits, shard_rank, tp_rank, tp, shard).items():
                    target = full.setdefault(name, torch.full(boxed.shape, float("nan")))
                    for offsets, view in boxed._views.items():
                        target[tuple(slice(o, o + s) for o, s in zip(offsets, view.shape))] = view
    return full


def test_every_layout_reassembles_the_same_full_weights():
    reference = reassembled(1, 1)
    assert not any(t.isnan().any() for t in reference.values())
    for tp, dp in [(1, 2), (2, 1), (2, 2), (4, 1), (4, 2)]:
        got = reassembled(tp, dp)
        assert got.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(got[name], tensor), (tp, dp, name)


def test_a_padded_vocabulary_starts_its_padding_at_zero_and_the_rest_as_the_unpadded_model():
    """600 ids (the last tile cut at 600 rows, as unpadded) in 1024 rows: over tp=4 rank 2 holds both, rank
    3 padding only; FSDP shards cut through them too. Every layout gives the same full weights."""
    small = dataclasses.replace(ARGS, dim=64)
    unpadded = reassembled(1, 1, dataclasses.replace(small, vocab_size=600))
    padded = dataclasses.replace(small, vocab_size=1024, valid_vocab_size=600)
    for tp, dp in [(1, 1), (4, 2)]:
        got = reassembled(tp, dp, padded)
        for name, tensor in unpadded.items():
            if name in VOCAB_PARAMETERS:
                assert torch.equal(got[name][:600], tensor) and not got[name][600:].any(), (tp, dp, name)
            else:
                assert torch.equal(got[name], tensor), (tp, dp, name)


def test_tiles_are_a_truncated_normal_of_the_configured_std():
    value = init.full_init_value("layers.0.attention.wqkv.weight", torch.Size([512, 512]), ARGS, 0)
    assert value.abs().max() <= 3 * 0.02 and abs(value.std().item() - 0.02 * 0.986) < 5e-4  # std of N truncated at 3


LLAMA3_70B = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / "llama3_70b.yaml")) | {"n_layers": 2}


def _counting_draws(monkeypatch) -> list[int]:
    drawn: list[int] = []
    draw_tile = init._draw_tile
    monkeypatch.setattr(init, "_draw_tile", lambda *a: _counted(draw_tile, drawn, *a))
    return drawn


def test_a_rank_of_llama3_70b_draws_only_its_share(monkeypatch):
    """llama3_70b with 2 layers on the meta device, TP rank 3 of 8 and FSDP shard 5 of 8 (one process
    simulating the rank; its shards built as FSDPUnit builds them): at most 2x the shard's own elements
    are drawn, not the rest of the TP slice. (A shard that is the whole slice, dp=1, is drawn the same
    way; the layouts' reassembly tests cover it at small sizes: its 5e8 draws here took 30 s of CI.)"""
    dp, shard_rank = 8, 5
    args = from_dict({"model": LLAMA3_70B, "seq_len": 128}).model
    drawn = _counting_draws(monkeypatch)
    tp_rank, tp = 3, 8
    start = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(args, TPContext(size=tp, rank=tp_rank))
    own = 0
    for unit in fsdp_unit_names(model):
        module = model.get_submodule(unit)
        spec = FlatParamSpec.of_module(module, dp)
        splits = tuple(TPSplit(getattr(p, "tp_dim", None), getattr(p, "tp_parts", None)) for p in module.parameters())
        fill_shard(torch.zeros(spec.shard_size), spec, shard_rank, splits, tp_rank, tp,
                   lambda n, *box: init.init_box(f"{unit}.{n}", *box, args, 0))
        own += spec.valid_in_shard(shard_rank)
    seconds = time.perf_counter() - start
    print(f"llama3_70b (2 layers), TP rank 3 of 8, shard {shard_rank} of {dp}: drew {sum(drawn) / own:.4f}x "
          f"its {own:,} elements in {seconds:.1f} s")
    assert own / 2 < sum(drawn) <= 2 * own


def _counted(draw_tile, drawn: list, *args):
    tile = draw_tile(*args)
    drawn.append(tile.numel())
    return tile


def test_no_two_tiles_of_llama3_8b_share_a_generator_across_two_seeds():
    """Every tile of every parameter of the full llama3_8b, for seeds 0 and 1, gets its own stream:
    two tiles with one seed would be exact copies (a seed sweep would share them)."""
    args = from_dict({"model": OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / "llama3_8b.yaml")),
                      "seq_len": 128}).model
    with torch.device("meta"):
        model = Transformer(args, TPContext())
    seeds = set()
    count = 0
    for name, p in model.named_parameters():
        tile = init._tile_shape(p.shape)
        grid = [range(-(-p.shape[d] // tile[d])) for d in range(min(p.dim(), 2))]
        for index in init._product(grid):
            for seed in (0, 1):
                seeds.add(init.tile_seed(seed, name, index))
                count += 1
    assert count > 900_000 and len(seeds) == count
