"""Grouped-query causal self-attention with rotary position embeddings.

RoPE uses the rotate-half layout (pairs i and i + head_dim/2), so checkpoints map one-to-one onto
Hugging Face's Llama weights without permuting the q/k rows; `model.rope_scaling` gives Llama 3.1's
frequencies. Positions are explicit: under context parallelism they are each rank's global token positions.

`model.attn_bias_type=block_causal` keeps attention inside documents: a token attends to the earlier
tokens of its own document only (packed sequences hold several). Without CP that is an explicit
[b, 1, s, s] mask (O(s^2) booleans per sequence), built once per forward and shared by every layer;
under CP each pair of chunks builds its own piece from the document ids. Rotary scores depend on
relative positions only, so a document sees the same attention wherever it sits.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model.args import ModelArgs, RopeScaling
from model.attention_kernels import PINNED, pinned_attention
from model.fp8 import Fp8Gemm
from parallel.context_parallel import CPContext, context_parallel_attention
from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPContext


class RotaryEmbedding(nn.Module):
    """No buffers: the frequencies are recomputed in fp32 so a dtype cast of the model cannot touch them."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None):
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """The [head_dim / 2] fp32 rotation frequencies, with transformers' operations in its order."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.int64, device=device).float()
        inv_freq = 1.0 / (self.theta ** (exponents / self.head_dim))
        return inv_freq if self.scaling is None else llama3_scaled(inv_freq, self.scaling)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of shape [seq, head_dim], computed in fp32 then cast to the compute dtype."""
        inv_freq = self.inv_freq(positions.device)
        freqs = positions.float()[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def llama3_scaled(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's frequencies, as transformers' `_compute_llama3_parameters` computes them: low
    frequencies divided by `factor`, high ones kept, and a linear blend of both in between."""
    context = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = context / scaling.low_freq_factor, context / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (context / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]."""
    return x * cos + _rotate_half(x) * sin


@dataclass(frozen=True)
class Documents:
    """The packed documents of a microbatch (block_causal): `ids` [batch, seq] of the whole sequence,
    under CP too; `mask` its block_causal_mask, None under CP (which masks chunk by chunk); `bias` the
    mask as the additive bias SDPA makes of it, in the blocks' dtype (attention_bias)."""

    ids: torch.Tensor
    mask: torch.Tensor | None
    bias: torch.Tensor | None = None

    def mask_for(self, dtype: torch.dtype, impl: str) -> torch.Tensor | None:
        """What causal_attention takes for queries of `dtype`: the shared bias, where SDPA would otherwise
        make its own of the bool mask in every layer (kept for the backward by the memory-efficient and
        cuDNN kernels: layers x batch x seq^2 elements); the bool mask for the math formula or another dtype."""
        if impl != "math" and self.bias is not None and self.bias.dtype == dtype:
            return self.bias
        return self.mask


def attention_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool attention mask as SDPA turns it into an additive one: 0 where attended, -inf elsewhere."""
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(~mask, float("-inf"))


def block_causal_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq] document ids -> [batch, 1, seq, seq] bool: query i may attend key j when j <= i and
    both are in the same document."""
    seq = document_ids.shape[1]
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    return (same_document & causal)[:, None]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, impl: str,
                     mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention core on [batch, heads, seq, head_dim]; k/v may have fewer (grouped) heads. `mask`
    (block_causal_mask, or for SDPA its attention_bias in q's dtype) replaces the plain causal mask.
    `impl`: model.efficient_attn (attention_kernels.py)."""
    if impl in PINNED:
        return pinned_attention(q, k, v, impl, mask)
    if impl == "sdpa" and mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    if impl == "sdpa":
        # CUDA runs grouped K/V only in the flash and math kernels, and flash takes no mask: with the heads
        # expanded the memory-efficient kernel takes the mask instead of math's seq x seq fp32 scores.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    # "math": the plain formula, a reference that any fused kernel must match.
    scores = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if mask is None:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~mask, float("-inf"))
    # The softmax runs in fp32 at least: fp64 stays fp64, a reference to 1e-15.
    return torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), dim=-1).to(q.dtype) @ v


def block_gemm(args: ModelArgs) -> Fp8Gemm | None:
    """The matmul of a transformer-block linear: fp8 under model.use_fp8, else a plain one (None).
    Embedding, norms and the output head always stay in the compute dtype."""
    recipe = args.fp8_recipe()
    return None if recipe is None else Fp8Gemm(recipe)


class AttentionCore(nn.Module):
    """softmax(q k^T) v as a module of its own, so selective checkpointing can recompute just this.
    Under context parallelism the queries are this rank's share of the sequence and the keys come
    from every CP rank (parallel/context_parallel/)."""

    def __init__(self, impl: str, cp: CPContext):
        super().__init__()
        self.impl, self.cp = impl, cp

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        if self.cp.size > 1:
            return context_parallel_attention(q, k, v, self.cp, None if documents is None else documents.ids)
        mask = None if documents is None else documents.mask_for(q.dtype, self.impl)
        return causal_attention(q, k, v, self.impl, mask)


class Attention(nn.Module):
    """One fused column-parallel q/k/v projection (each TP rank owns whole heads: n_heads/tp query
    heads and the n_kv_heads/tp KV heads they share), row-parallel output projection."""

    def __init__(self, args: ModelArgs, tp: TPContext, cp: CPContext):
        super().__init__()
        self.tp, self.head_dim = tp, args.head_dim
        self.core = AttentionCore(args.efficient_attn, cp)
        kv = args.n_kv_heads * args.head_dim
        self.wqkv = ColumnParallelLinear(args.dim, (args.n_heads * args.head_dim, kv, kv), tp, block_gemm(args))
        self.wo = RowParallelLinear(args.n_heads * args.head_dim, args.dim, tp, block_gemm(args))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        x = self.tp.enter(x)
        bsz, seq, _ = x.shape
        q, k, v = self.rotated_qkv(x, cos, sin)
        out = self.core(q, k, v, documents)
        return self.wo(out.transpose(1, 2).reshape(bsz, seq, -1))

    def rotated_qkv(self, x: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [batch, seq, dim] (in the TP region) -> q, k, v [batch, heads, seq, head_dim], q and k rotated.
        Its own method so that decoding with a KV cache (model/kv_cache.py) projects exactly as training does."""
        bsz, seq, _ = x.shape
        q, k, v = (t.view(bsz, seq, -1, self.head_dim).transpose(1, 2) for t in self.wqkv.split(self.wqkv(x)))
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v
