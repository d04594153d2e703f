"""A model built on the meta device and initialized unit by unit while FSDP shards it holds exactly
the weights of an eagerly initialized model: the path the trainer uses for every model size."""

import torch

from model.args import ModelArgs
from model.init import ModelInitializer, init_weights
from model.transformer import Transformer
from parallel.fsdp import FSDPConfig, fully_shard

ARGS = ModelArgs(n_layers=2, dim=32, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16, max_seq_len=8)
UNITS = ["tok_embeddings", "layers.0", "layers.1", "head"]


def test_meta_model_materialized_per_unit_equals_eager_init(world):
    eager = Transformer(ARGS)
    init_weights(eager, ARGS, seed=5)
    eager_root = fully_shard(eager, UNITS, world, None, FSDPConfig())
    with torch.device("meta"):
        lazy = Transformer(ARGS)
    lazy_root = fully_shard(lazy, UNITS, world, None, FSDPConfig(), init=ModelInitializer(ARGS, 5, torch.device("cpu")))
    for a, b in zip(eager_root.units, lazy_root.units):
        assert b.flat_param.device.type == "cpu" and torch.equal(a.flat_param, b.flat_param), a.name
    tokens = torch.randint(0, ARGS.vocab_size, (2, 8))
    assert torch.equal(eager(tokens), lazy(tokens))
