"""Initialization draws per tile: every layout reassembles the same full weights, bitwise, and a rank
of a large model draws about its own share, never the unsliced parameters."""

import time

import torch
from omegaconf import OmegaConf

import model.init as init
from model.args import ModelArgs
from model.transformer import Transformer
from parallel.fsdp import FSDPConfig, fully_shard
from parallel.fsdp.flat_param import FlatParamSpec, flatten, shard_of
from parallel.fsdp.state_dict import TPSplit, boxed_parameters
from parallel.tensor_parallel import TPContext
from tests.e2e.launch import REPO
from trainer.config import from_dict
from trainer.parallelize import fsdp_unit_names

# Big enough that TP slices cut through tiles (wqkv parts 256/128/128 over tp=4: 64-row slices).
ARGS = ModelArgs(n_layers=1, dim=256, n_heads=4, n_kv_heads=2, vocab_size=640, multiple_of=64, max_seq_len=8)


def reassembled(tp: int, dp: int) -> dict[str, torch.Tensor]:
    """Full weights rebuilt from every (TP rank, shard rank)'s initialized flat shard."""
    full: dict[str, torch.Tensor] = {}
    for tp_rank in range(tp):
        ctx = TPContext(size=tp, rank=tp_rank)
        with torch.device("meta"):
            model = Transformer(ARGS, ctx)
        for unit in fsdp_unit_names(model):
            module = model.get_submodule(unit)
            named = list(module.named_parameters())
            spec = FlatParamSpec.of_module(module, dp)
            values = [init.local_init_value(f"{unit}.{n}", p, ARGS, 9, ctx) for n, p in named]
            splits = tuple(TPSplit(getattr(p, "tp_dim", None), getattr(p, "tp_parts", None)) for _, p in named)
            flat = flatten(values, spec)
            for shard_rank in range(dp):
                shard = shard_of(flat, spec, shard_rank)
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


def test_tiles_are_a_truncated_normal_of_the_configured_std():
    value = init.full_init_value("layers.0.attention.wqkv.weight", torch.Size([512, 512]), ARGS, 0)
    assert value.abs().max() <= 3 * 0.02 and abs(value.std().item() - 0.02 * 0.986) < 5e-4  # std of N truncated at 3


def test_a_rank_of_llama3_70b_draws_only_its_share(world, monkeypatch):
    """llama3_70b with 2 layers, TP rank 3 of 8, built on the meta device and sharded by FSDP (one
    process simulating the rank): at most 2x its own parameter count is drawn."""
    raw = OmegaConf.to_container(OmegaConf.load(REPO / "conf" / "model" / "llama3_70b.yaml")) | {"n_layers": 2}
    args = from_dict({"model": raw, "seq_len": 128}).model_args()
    drawn = []
    draw_tile = init._draw_tile
    monkeypatch.setattr(init, "_draw_tile", lambda *a: _counted(draw_tile, drawn, *a))
    tp = TPContext(size=8, rank=3)
    start = time.perf_counter()
    with torch.device("meta"):
        model = Transformer(args, tp)
    own = sum(p.numel() for n, p in model.named_parameters() if not n.endswith("norm.weight"))
    fully_shard(model, fsdp_unit_names(model), world, None, FSDPConfig(),
                materialize=lambda n, p: init.local_init_value(n, p, args, 0, tp))
    seconds = time.perf_counter() - start
    print(f"llama3_70b (2 layers), TP rank 3 of 8: drew {sum(drawn) / own:.4f}x its {own:,} parameters in {seconds:.1f} s")
    assert own < sum(drawn) <= 2 * own


def _counted(draw_tile, drawn: list, *args):
    tile = draw_tile(*args)
    drawn.append(tile.numel())
    return tile
