"""Our parameters in Hugging Face's Llama layout: names, fused parts, and config.json.

Our RoPE is rotate-half and our RMSNorm is HF's, so weights map by name alone: a fused parameter
(q/k/v, gate/up) is its HF parts stacked along dim 0, in part order; nothing is permuted or reshaped.
Export (scripts/export_hf.py), import (checkpoint.init_from_hf) and generation (scripts/generate.py)
go through this mapping. A tied model (model.tie_embeddings) has no head.output.weight, so, as
transformers saves a tied Llama, no lm_head.weight: its head is the embedding.
"""

import dataclasses
from collections.abc import Callable

import torch

from model.args import ModelArgs, RopeScaling
from model.transformer import VOCAB_PARAMETERS, Transformer

_TOP_LEVEL = {
    "tok_embeddings.weight": ("model.embed_tokens.weight",),
    "head.norm.weight": ("model.norm.weight",),
    "head.output.weight": ("lm_head.weight",),
}
_PER_LAYER = {
    "attention.wqkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attention.wo.weight": ("self_attn.o_proj.weight",),
    "feed_forward.w13.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "feed_forward.w2.weight": ("mlp.down_proj.weight",),
    "attention_norm.weight": ("input_layernorm.weight",),
    "ffn_norm.weight": ("post_attention_layernorm.weight",),
}
# config.json field -> the ModelArgs attribute it must equal.
CONFIG_FIELDS = {
    "hidden_size": "dim", "intermediate_size": "ffn_hidden_dim", "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads", "head_dim": "head_dim",
    "vocab_size": "vocab_size", "rms_norm_eps": "norm_eps", "rope_theta": "rope_theta",
    "tie_word_embeddings": "tie_embeddings",
}


def hf_names(name: str) -> tuple[str, ...]:
    """Our parameter name -> the Hugging Face Llama name(s) of its part(s) (KeyError if unknown)."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    prefix, index, rest = name.split(".", 2)
    if prefix != "layers":
        raise KeyError(name)
    return tuple(f"model.layers.{index}.{hf}" for hf in _PER_LAYER[rest])


def part_sizes(param: torch.Tensor) -> tuple[int, ...]:
    """Sizes along dim 0 of a full parameter's HF parts (one part unless fused)."""
    return getattr(param, "tp_parts", None) or (param.shape[0],)


def _meta_params(args: ModelArgs) -> dict[str, torch.nn.Parameter]:
    """The full (unsharded) parameters of the model `args` describes, without memory."""
    with torch.device("meta"):
        return dict(Transformer(args).named_parameters())


def hf_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """{Hugging Face tensor name: its shape} of the model `args` describes."""
    return {hf: (size, *param.shape[1:]) for name, param in _meta_params(args).items()
            for hf, size in zip(hf_names(name), part_sizes(param))}


def to_hf(weights: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our full weights -> the Hugging Face tensors of the model `args` describes, splitting fused parameters
    into their parts. Its vocabulary may be smaller than the weights': their padding rows are left out."""
    params = _meta_params(args)
    out = {}
    for name, tensor in weights.items():
        if name in VOCAB_PARAMETERS:
            tensor = tensor[: args.vocab_size]
        out.update(zip(hf_names(name), tensor.split(part_sizes(params[name]), dim=0)))
    return out


def from_hf(read: Callable[[str], torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Hugging Face tensors (`read` gives one by name) -> our full weights, the inverse of to_hf: a fused
    parameter is its parts stacked along dim 0, in part order."""
    weights = {}
    for name in _meta_params(args):
        parts = [read(hf) for hf in hf_names(name)]
        weights[name] = parts[0] if len(parts) == 1 else torch.cat(parts)
    return weights


def hf_config(args: ModelArgs, dtype_name: str, bos_id: int, eos_id: int | list[int],
              max_positions: int | None = None) -> dict:
    """LlamaConfig fields; rope_theta, rope_scaling and torch_dtype are the spellings both transformers 4
    and 5 read. max_position_embeddings, the context inference servers allow, is the training seq_len
    unless given."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **{field: getattr(args, attr) for field, attr in CONFIG_FIELDS.items()},
        "max_position_embeddings": args.max_seq_len if max_positions is None else max_positions,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": dtype_name,
        **({} if args.rope_scaling is None else {"rope_scaling": hf_rope_scaling(args.rope_scaling)}),
    }


def hf_rope_scaling(scaling: RopeScaling) -> dict:
    """model.rope_scaling as config.json's rope_scaling spells it."""
    fields = dataclasses.asdict(scaling)
    return {"rope_type": fields.pop("type"), **fields}
