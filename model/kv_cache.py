"""Decoding with a KV cache: the model's forward over new tokens only, attending to the keys and values
of every token before them.

It runs the Transformer's own modules (embedding, norms, q/k/v projection and RoPE, feed-forward, head)
on the model's own weights; only the attention core differs, since queries see cached keys. Keys are
cached rotated, with their absolute positions, by the model's RotaryEmbedding (so model.rope_scaling
applies). The training forward is untouched. One process, the whole model: no TP, CP or pipeline chunks.
"""

import torch

from model.attention import Attention, causal_attention
from model.transformer import Transformer, TransformerBlock


class KVCache:
    """Each layer's rotated keys and values, [batch, kv_heads, capacity, head_dim], allocated once for
    `capacity` tokens (prompt and completion), so a step writes one slot instead of copying the cache."""

    def __init__(self, model: Transformer, batch: int, capacity: int):
        args, weight = model.args, next(model.parameters())  # the model's dtype and device
        shape = (batch, args.n_kv_heads, capacity, args.head_dim)
        self.keys = {name: weight.new_empty(shape) for name in model.layers}
        self.values = {name: weight.new_empty(shape) for name in model.layers}
        self.length = 0  # tokens cached so far, in every layer

    def extend(self, layer: str, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens' k and v after the cached ones; returns all of this layer's so far."""
        end = self.length + k.shape[2]
        if end > self.keys[layer].shape[2]:
            raise ValueError(f"the KV cache holds {self.keys[layer].shape[2]} tokens; {end} do not fit")
        self.keys[layer][:, :, self.length:end] = k
        self.values[layer][:, :, self.length:end] = v
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]


def forward_cached(model: Transformer, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """tokens [batch, new] that follow the cache's -> logits [batch, new, vocab], the cache extended by
    them. The first call (an empty cache) is the prefill of the whole prompt; later calls add a token."""
    _check_whole(model)
    start, new = cache.length, tokens.shape[1]
    h = model.tok_embeddings(tokens)
    cos, sin = model.rope(torch.arange(start, start + new, device=h.device), h.dtype)
    # Query i is token start + i: it sees every cached key and the new ones up to itself.
    mask = torch.ones(new, start + new, dtype=torch.bool, device=h.device).tril(start)
    # The cache's mask rules out flash; decoding is short: torch picks, unless the reference is asked for.
    impl = "math" if model.args.efficient_attn == "math" else "sdpa"
    for name, block in model.layers.items():
        h = h + _attend(block.attention, block.attention_norm(h), cos, sin, cache, name, mask, impl)
        h = h + block.feed_forward(block.ffn_norm(h))
    cache.length += new
    return model.logits(h)


def _attend(attention: Attention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache,
            layer: str, mask: torch.Tensor, impl: str) -> torch.Tensor:
    """Attention.forward with the keys and values of the earlier tokens taken from the cache."""
    bsz, seq, _ = x.shape
    q, k, v = attention.rotated_qkv(x, cos, sin)
    k, v = cache.extend(layer, k, v)
    out = causal_attention(q, k, v, impl, mask)
    return attention.wo(out.transpose(1, 2).reshape(bsz, seq, -1))


def _check_whole(model: Transformer) -> None:
    """The cached forward runs the plain blocks of a whole model in one process."""
    if model.tp.size > 1 or model.cp.size > 1 or model.tok_embeddings is None or model.head is None:
        raise ValueError("decoding with a KV cache needs the whole model in one process (no TP, CP or pipeline)")
    if not all(type(block) is TransformerBlock for block in model.layers.values()):
        raise ValueError("decoding with a KV cache runs the in-tree TransformerBlock only")
