"""Decoding with a KV cache (model/kv_cache.py) gives, step by step, the logits the model's own forward
computes over the whole prefix again, within fp32 rounding: with grouped KV heads, llama3 RoPE scaling
past the original context, a batch of two, and a prefill split into chunks."""

import dataclasses

import pytest
import torch

from model.args import ModelArgs, RopeScaling
from model.init import init_weights
from model.kv_cache import KVCache, forward_cached
from model.transformer import Transformer
from parallel.tensor_parallel import TPContext

ARGS = ModelArgs(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=64,
                 rope_scaling=RopeScaling(original_max_position_embeddings=16))
# A prefill of 20 tokens, a chunk of 7, then one token per step: 40 positions, past the 16 of the original context.
CHUNKS = (20, 7, *[1] * 13)


def random_model(impl: str) -> Transformer:
    args = dataclasses.replace(ARGS, efficient_attn=impl)
    model = Transformer(args)
    init_weights(model, args, seed=0)
    return model.eval()


@pytest.mark.parametrize("impl", ["sdpa", "math"])
def test_each_cached_step_gives_the_logits_of_a_forward_without_cache(impl: str) -> None:
    model = random_model(impl)
    tokens = torch.randint(0, ARGS.vocab_size, (2, sum(CHUNKS)), generator=torch.Generator().manual_seed(0))
    cache = KVCache(model, batch=2, capacity=sum(CHUNKS))
    start = 0
    with torch.no_grad():
        for size in CHUNKS:
            end = start + size
            cached = forward_cached(model, tokens[:, start:end], cache)
            recomputed = model(tokens[:, :end])[:, start:end]
            torch.testing.assert_close(cached, recomputed, rtol=1e-5, atol=1e-5)
            start = end
    assert cache.length == sum(CHUNKS)


def test_the_cache_refuses_what_it_cannot_decode() -> None:
    """More tokens than it holds, and a model split over tensor-parallel ranks, are errors, not wrong logits."""
    model = random_model("sdpa")
    cache = KVCache(model, batch=1, capacity=4)
    with torch.no_grad(), pytest.raises(ValueError, match="holds 4 tokens; 5 do not fit"):
        forward_cached(model, torch.zeros(1, 5, dtype=torch.long), cache)
    with torch.device("meta"):
        sharded = Transformer(ARGS, TPContext(size=2, rank=0))
    with pytest.raises(ValueError, match="whole model in one process"):
        forward_cached(sharded, torch.zeros(1, 1, dtype=torch.long, device="meta"), cache)
