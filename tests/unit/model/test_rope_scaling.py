"""model.rope_scaling: Llama 3.1's RoPE frequencies are transformers' (rope_type "llama3"), and without it
the rotary embedding is transformers' default one."""

import dataclasses

import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from model.args import ModelArgs, RopeScaling
from model.attention import llama3_scaled
from model.transformer import Transformer

# head_dim 32 and theta 1e4: wavelengths from 2 pi (6.3) up, so a context of 32 (high-frequency wavelengths below
# 32 / 4 = 8, low-frequency above 32 / 1) puts frequencies in each of the three bands; positions run to 4x past it.
ARGS = ModelArgs(n_layers=1, dim=128, n_heads=4, n_kv_heads=2, rope_theta=10000.0, max_seq_len=128)
SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32)
POSITIONS = torch.arange(4 * SCALING.original_max_position_embeddings)


def transformers_cos_sin(args: ModelArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' Llama rotary embedding of `args`, at POSITIONS, in fp32."""
    scaling = None if args.rope_scaling is None else {
        "rope_type": "llama3", **{k: v for k, v in dataclasses.asdict(args.rope_scaling).items() if k != "type"}}
    config = transformers.LlamaConfig(hidden_size=args.dim, num_attention_heads=args.n_heads, head_dim=args.head_dim,
                                      num_key_value_heads=args.n_kv_heads, rope_theta=args.rope_theta,
                                      rope_scaling=scaling, max_position_embeddings=args.max_seq_len)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), POSITIONS[None])
    return cos[0], sin[0]


@pytest.mark.parametrize("scaling", [SCALING, None], ids=["llama3", "unscaled"])
def test_cos_sin_are_transformers(scaling: RopeScaling | None) -> None:
    args = dataclasses.replace(ARGS, rope_scaling=scaling)
    ours = Transformer(args).rope(POSITIONS, torch.float32)  # the model's own, as built from its args
    for mine, theirs in zip(ours, transformers_cos_sin(args)):
        torch.testing.assert_close(mine, theirs, atol=1e-6, rtol=0)


def test_scaling_changes_the_low_frequencies_only() -> None:
    """Each band is exercised: high frequencies kept, low ones divided by the factor, the middle blended;
    so positions past the original context rotate differently than unscaled."""
    scaled, unscaled = Transformer(dataclasses.replace(ARGS, rope_scaling=SCALING)).rope, Transformer(ARGS).rope
    inv_freq = unscaled.inv_freq(torch.device("cpu"))
    assert torch.equal(llama3_scaled(inv_freq, SCALING), scaled.inv_freq(torch.device("cpu")))
    ratio = inv_freq / scaled.inv_freq(torch.device("cpu"))
    kept, divided = ratio == 1, torch.isclose(ratio, torch.tensor(SCALING.factor))
    assert kept.any() and divided.any() and (~kept & ~divided).any(), ratio
    (cos, _), (cos_unscaled, _) = scaled(POSITIONS, torch.float32), unscaled(POSITIONS, torch.float32)
    assert (cos - cos_unscaled)[SCALING.original_max_position_embeddings:].abs().max() > 0.5
