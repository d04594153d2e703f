"""Export a training checkpoint as a Hugging Face Llama folder: config.json, model.safetensors, tokenizer.model
and tokenizer_config.json (transformers reads the tokenizer with `sentencepiece` and `protobuf` installed).

Evaluation harnesses and inference servers read Hugging Face's layout, not DCP shards. The export runs
as one plain process (no torchrun, no process group): the manifest is verified locally and DCP loads in
its single-process mode. Our RoPE is rotate-half and our RMSNorm is HF's, so weights map by name (fused
q/k/v and gate/up split into their parts): no permutation of q/k, no reshaping.

    python scripts/export_hf.py CHECKPOINT_DIR OUT_DIR [--dtype fp32|bf16]
"""

import sys
from pathlib import Path

# Scripts run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import warnings  # noqa: E402

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from model.args import ModelArgs  # noqa: E402
from model.transformer import Transformer  # noqa: E402
from parallel.errors import ConfigError  # noqa: E402
from trainer.checkpoint import MANIFEST, checkpoint_files_problem, latest_checkpoint  # noqa: E402
from trainer.config import TrainConfig, from_dict  # noqa: E402
from trainer.state import load_full_weights  # noqa: E402
from trainer.tokenizer import BOS_ID, EOS_ID  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
_TOP_LEVEL = {
    "tok_embeddings.weight": ("model.embed_tokens.weight",),
    "head.norm.weight": ("model.norm.weight",),
    "head.output.weight": ("lm_head.weight",),
}
# Fused parameters map to one Hugging Face tensor per part (q/k/v, gate/up), in part order.
_PER_LAYER = {
    "attention.wqkv.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "attention.wo.weight": ("self_attn.o_proj.weight",),
    "feed_forward.w13.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "feed_forward.w2.weight": ("mlp.down_proj.weight",),
    "attention_norm.weight": ("input_layernorm.weight",),
    "ffn_norm.weight": ("post_attention_layernorm.weight",),
}


def hf_names(name: str) -> tuple[str, ...]:
    """Our parameter name -> the Hugging Face Llama name(s) of its part(s) (KeyError if unknown)."""
    if name in _TOP_LEVEL:
        return _TOP_LEVEL[name]
    prefix, index, rest = name.split(".", 2)
    if prefix != "layers":
        raise KeyError(name)
    return tuple(f"model.layers.{index}.{hf}" for hf in _PER_LAYER[rest])


def to_hf(weights: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """Our full weights -> Hugging Face tensors, splitting fused parameters into their parts."""
    with torch.device("meta"):
        params = dict(Transformer(args).named_parameters())
    out = {}
    for name, tensor in weights.items():
        parts = getattr(params[name], "tp_parts", None) or (tensor.shape[0],)
        out.update(zip(hf_names(name), tensor.split(parts, dim=0)))
    return out


def hf_config(args: ModelArgs, dtype: torch.dtype) -> dict:
    """LlamaConfig fields; rope_theta and torch_dtype are the spellings both transformers 4 and 5 read."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "vocab_size": args.vocab_size,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "torch_dtype": _HF_DTYPE_NAMES[dtype],
    }


def read_train_config(ckpt: Path) -> TrainConfig:
    """The run's config, saved next to the shards; the manifest has already vouched for its bytes."""
    try:
        raw = json.loads((ckpt / "train_config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint {ckpt} has no readable train_config.json: {e}")
    return from_dict(raw)


def export(ckpt: Path, out: Path, dtype: torch.dtype) -> None:
    """Verify every file's sha256 first: DCP itself would load flipped bits without a word."""
    if not (ckpt / MANIFEST).is_file():
        newest = latest_checkpoint(ckpt / "checkpoints")
        hint = f"; its newest complete checkpoint is {newest}" if newest else ""
        raise ConfigError(f"{ckpt} is not a checkpoint (a step_N folder under dump_dir/checkpoints){hint}")
    problem = checkpoint_files_problem(ckpt, rank=0, world=1, checksums=True)
    if problem:
        raise ConfigError(problem)
    cfg = read_train_config(ckpt)
    args = cfg.model_args()
    with warnings.catch_warnings():
        # Single-process loading is the intent here, not an accident DCP should warn about.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        weights = load_full_weights(ckpt, cfg)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: t.to(dtype).contiguous() for n, t in to_hf(weights, args).items()}
    (out / "config.json").write_text(json.dumps(hf_config(args, dtype), indent=2) + "\n")
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    # safetensors writes through a private temp file (mode 0600); give it the mode the umask gave config.json.
    shutil.copymode(out / "config.json", out / "model.safetensors")
    shutil.copyfile(ckpt / "tokenizer.model", out / "tokenizer.model")
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")


def tokenizer_config() -> dict:
    """How transformers must read tokenizer.model to give training's ids: BOS first (packing puts one
    before every document), no EOS appended, no space prefixed (the BPE was trained without one)."""
    return {
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": False, "add_prefix_space": False,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a step_N folder under {dump_dir}/checkpoints")
    parser.add_argument("out", type=Path, help="folder to write the Hugging Face model into")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    opts = parser.parse_args(argv)
    try:
        export(opts.checkpoint, opts.out, DTYPES[opts.dtype])
    except (ConfigError, OSError) as e:  # OSError: an unwritable OUT_DIR or a missing tokenizer.model
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"exported {opts.checkpoint} to {opts.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
