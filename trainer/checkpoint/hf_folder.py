"""A Hugging Face Llama folder as `checkpoint.init_from_hf` reads it: config.json (the architecture, RoPE under
each spelling transformers reads, the token ids), and which safetensors file holds each tensor, with its
shape (headers only). Everything here runs before any process group, so a folder that would not import
is one error line at once; hf_import.py then reads the weights.
"""

import dataclasses
import json
from pathlib import Path

from safetensors import SafetensorError, safe_open

from model.args import ModelArgs, RopeScaling
from model.hf import CONFIG_FIELDS, hf_names, hf_shapes
from model.transformer import TIED_COPY
from parallel.errors import ConfigError
from trainer.data.tokenizer import Tokenizer

KEY = "checkpoint.init_from_hf"
INDEX = "model.safetensors.index.json"


def read_hf_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"{KEY}={folder}: no readable config.json ({e.__class__.__name__}: {e})")
    if not isinstance(config, dict):
        raise ConfigError(f"{KEY}={folder}: config.json holds a JSON {type(config).__name__}, not an object")
    for field in _ROPE_FIELDS:
        if not isinstance(config.get(field) or {}, dict):
            raise ConfigError(f"{KEY}={folder}: config.json's {field}={config[field]!r} is not an object")
    return config


def open_safetensors(folder: Path, path: Path):
    """safe_open, with a missing or damaged file as one error line naming it."""
    try:
        return safe_open(path, framework="pt")
    except (OSError, SafetensorError) as e:
        raise ConfigError(f"{KEY}={folder}: {path.name} is not a readable safetensors file ({e})") from e


# config.json fields our model has no equivalent for, and the values it implies (transformers maps
# "swish" to the same function as "silu"; the model has no dropout, so any other rate would be dropped).
_UNSUPPORTED = {"attention_bias": (False,), "mlp_bias": (False,), "hidden_act": ("silu", "swish"),
                "attention_dropout": (0.0,)}


# The safetensors dtypes a weight may be stored in; float8 and integers are quantized values that need scales.
_WEIGHT_DTYPES = ("F32", "BF16", "F16", "F64")


# What transformers' LlamaConfig takes for these fields when config.json leaves them out (the number of
# key/value heads defaults to the number of heads).
_LLAMA_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
                   "tie_word_embeddings": False}
# Where RoPE settings may be: transformers 4 reads rope_scaling, 5 reads `rope_scaling or rope_parameters`.
_ROPE_FIELDS = ("rope_scaling", "rope_parameters")
_ROPE_KINDS = ("default", "llama3")  # llama3: model.rope_scaling


def check_hf_folder(folder: Path, args: ModelArgs) -> None:
    """Before any process group: the folder imports into the configured model, or one error line."""
    config = read_hf_config(folder)
    check_architecture(config, args, folder)
    check_tensor_shapes(folder, args)


def check_token_ids(config: dict, tokenizer: Tokenizer, folder: Path) -> None:
    """config.json's bos and eos ids are the tokenizer's: weights trained with other ids would take every
    document boundary packing writes for another token. A list of eos ids (instruct models) must hold it."""
    for field, ours in (("bos_token_id", tokenizer.bos_id), ("eos_token_id", tokenizer.eos_id)):
        theirs = config.get(field)
        if theirs is not None and ours not in (theirs if isinstance(theirs, list) else [theirs]):
            raise ConfigError(f"{KEY}={folder}: config.json's {field}={theirs!r} is not the id of the tokenizer's "
                              f"{field.split('_')[0]} token ({tokenizer.path}: {ours})")


def check_vocab(config: dict, tokenizer: Tokenizer, folder: Path, padded: bool) -> None:
    """make_vocab_size_divisible_by (`padded`) pads only a folder of its tokenizer's size: a folder already
    padded beyond it keeps its own vocabulary, which an export then writes back (config/vocab.py)."""
    size = config.get("vocab_size")
    if padded and type(size) is int and size > tokenizer.vocab_size:
        raise ConfigError(f"{KEY}={folder}: config.json's vocab_size={size} already pads its tokenizer's "
                          f"{tokenizer.vocab_size} ids ({tokenizer.path}); make_vocab_size_divisible_by pads only a "
                          "vocabulary of the tokenizer's size: set it to null to keep the folder's")


def check_tensor_shapes(folder: Path, args: ModelArgs) -> None:
    """Every tensor the model needs is in the folder with its shape (safetensors headers only): a
    larger tensor would otherwise be cut to the configured size without a word. A tied model reads no
    lm_head.weight, and a tied folder that ships one is refused: transformers 4 would read the embedding as
    the head, transformers 5 the lm_head.weight where the two differ."""
    files = tensor_files(folder)
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for path in sorted(set(files.values())):
        with open_safetensors(folder, path) as f:
            for name in (name for name in f.keys() if files.get(name) == path):
                piece = f.get_slice(name)
                shapes[name], dtypes[name] = tuple(piece.get_shape()), piece.get_dtype()
    head = hf_names(TIED_COPY)[0]
    if args.tie_embeddings and head in shapes:
        raise ConfigError(f"{KEY}={folder}: tie_word_embeddings=true, but it ships {head} too, which transformers 5 "
                          f"reads as an untied head where it differs from the embedding: remove {head}, or untie both "
                          "(tie_word_embeddings=false, model.tie_embeddings=false)")
    for name, expected in hf_shapes(args).items():
        if name not in shapes:
            raise ConfigError(f"{KEY}={folder}: tensor {name} is missing")
        if shapes[name] != expected:
            raise ConfigError(f"{KEY}={folder}: tensor {name} has shape {list(shapes[name])}, the configured "
                              f"model needs {list(expected)}")
        if dtypes[name] not in _WEIGHT_DTYPES:  # a quantized value read as a weight, its scale left out
            raise ConfigError(f"{KEY}={folder}: tensor {name} is {dtypes[name]}, not a floating-point weight "
                              f"({', '.join(_WEIGHT_DTYPES)}): a quantized checkpoint does not import")


def check_supported(config: dict, folder: Path) -> None:
    """config.json asks for nothing this model lacks: one line naming the field otherwise."""
    if config.get("model_type") not in (None, "llama"):
        raise ConfigError(f"{KEY}={folder}: model_type is {config['model_type']!r}, only 'llama' imports")
    if config.get("quantization_config") is not None:  # its weights are stored quantized, beside their scales
        method = config["quantization_config"]
        method = method.get("quant_method", "unnamed") if isinstance(method, dict) else method
        raise ConfigError(f"{KEY}={folder}: config.json has a quantization_config ({method!r}): a quantized "
                          "checkpoint does not import; use the unquantized release")
    for field, implied in _UNSUPPORTED.items():
        if config.get(field, implied[0]) not in implied:
            raise ConfigError(f"{KEY}={folder}: config.json has {field}={config[field]!r}; this model supports "
                              f"only {' or '.join(map(repr, implied))}")
    hidden, heads, head_dim = (config.get(k) for k in ("hidden_size", "num_attention_heads", "head_dim"))
    if all(type(n) is int and n > 0 for n in (hidden, heads)) and head_dim not in (None, hidden // heads):
        raise ConfigError(f"{KEY}={folder}: config.json has head_dim={head_dim!r}; this model supports only "
                          f"hidden_size / num_attention_heads ({hidden // heads})")
    for field in _ROPE_FIELDS:
        kind = _rope_kind(config.get(field) or {})
        if kind not in _ROPE_KINDS:
            raise ConfigError(f"{KEY}={folder}: config.json's {field} asks for {kind!r} RoPE scaling; this model "
                              "supports only the default RoPE or 'llama3' (model.rope_scaling)")


def _with_defaults(config: dict, folder: Path) -> dict:
    """config.json with what transformers' LlamaConfig takes where it is silent, rope_theta resolved."""
    hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
    sizes_given = all(type(n) is int and n > 0 for n in (hidden, heads))  # else named as they differ
    return {"head_dim": hidden // heads if sizes_given else None, "num_key_value_heads": heads,
            **_LLAMA_DEFAULTS} | {k: v for k, v in config.items() if v is not None} | {
        "rope_theta": _rope_theta(config, folder)}


# config.json field -> the model.* key it gives (model=hf); head_dim follows from dim and n_heads.
_KEY_FIELDS = {("intermediate_size" if attr == "ffn_hidden_dim" else attr): field
               for field, attr in CONFIG_FIELDS.items() if attr != "head_dim"}
MODEL_KEYS = (*_KEY_FIELDS, "rope_scaling")


def model_keys(config: dict, folder: Path) -> dict[str, object]:
    """The model.* values (MODEL_KEYS) config.json describes, the RoPE scaling as a model.rope_scaling group."""
    check_supported(config, folder)
    config = _with_defaults(config, folder)
    keys = {key: config.get(field) for key, field in _KEY_FIELDS.items()}
    described = [_rope_description(config[field], config) for field in _ROPE_FIELDS if config.get(field)]
    if len(described) == 2 and described[0] != described[1]:
        raise ConfigError(f"{KEY}={folder}: config.json's rope_scaling describes {described[0] or 'the default RoPE'}, "
                          f"its rope_parameters {described[1] or 'the default RoPE'} (transformers 5 reads only "
                          "rope_scaling): make them agree or drop one")
    keys["rope_scaling"] = described[0] if described else None
    return keys


def _rope_description(rope: dict, config: dict) -> dict[str, object] | None:
    """A RoPE object as a model.rope_scaling group: None for the default RoPE."""
    return {"type": "llama3", **_llama3_fields(rope, config)} if _rope_kind(rope) == "llama3" else None


def check_architecture(config: dict, args: ModelArgs, folder: Path) -> None:
    """One line naming every config.json field that differs from the configured model."""
    check_supported(config, folder)
    config = _with_defaults(config, folder)
    differ = [f"{field}={config.get(field)!r} vs model.{attr}={getattr(args, attr)!r}"
              for field, attr in CONFIG_FIELDS.items() if not _agrees(config.get(field), attr, args)]
    differ += _rope_scaling_differences(config, args.rope_scaling)
    if differ:
        raise ConfigError(f"{KEY}={folder}: its config.json does not describe the configured model: "
                          f"{'; '.join(differ)}")


def _agrees(value: object, attr: str, args: ModelArgs) -> bool:
    """config.json's value is the model's; a vocabulary the model pads (make_vocab_size_divisible_by, once
    the tokenizer is known) may be just the tokenizer's ids."""
    padded_from = args.valid_vocab_size if attr == "vocab_size" else None
    return value == getattr(args, attr) or padded_from is not None and value == padded_from


def _rope_theta(config: dict, folder: Path) -> object:
    """config.json's rope_theta as transformers 5 resolves it: that of its RoPE object (rope_scaling, else
    rope_parameters), else the top level's (all transformers 4 reads), else 1e4. Spellings that disagree
    are refused: one version or the other would compute other logits than the import trains."""
    top = config.get("rope_theta")
    nested = {field: config[field] for field in _ROPE_FIELDS if config.get(field)}
    for field, rope in nested.items():
        if None not in (rope.get("rope_theta"), top) and rope["rope_theta"] != top:
            raise ConfigError(f"{KEY}={folder}: config.json has rope_theta={top!r} and {field}.rope_theta="
                              f"{rope['rope_theta']!r} (transformers 4 reads the first, 5 the second): make them agree")
    default = _LLAMA_DEFAULTS["rope_theta"]
    thetas = {field: _first_given(rope.get("rope_theta"), top, default) for field, rope in nested.items()}
    if len(thetas) == 2 and thetas["rope_scaling"] != thetas["rope_parameters"]:  # 5 never reads the second
        raise ConfigError(f"{KEY}={folder}: config.json's rope_scaling gives rope_theta={thetas['rope_scaling']!r}, "
                          f"its rope_parameters {thetas['rope_parameters']!r} (transformers 5 reads only "
                          "rope_scaling): make them agree or drop one")
    return next(iter(thetas.values()), _first_given(top, default))


def _first_given(*values: object) -> object:
    return next(v for v in values if v is not None)


def _rope_scaling_differences(config: dict, scaling: RopeScaling | None) -> list[str]:
    """Each RoPE object of config.json (none given: no scaling) against model.rope_scaling: its kind, then,
    both being llama3, each of its fields."""
    ropes = {field: config[field] for field in _ROPE_FIELDS if config.get(field)} or {_ROPE_FIELDS[0]: {}}
    ours = "model.rope_scaling=None" if scaling is None else f"model.rope_scaling.type={scaling.type!r}"
    differ = []
    for field, rope in ropes.items():
        if (_rope_kind(rope) == "llama3") != (scaling is not None):
            differ.append(f"{_rope_setting(field, rope)} vs {ours}")
        elif scaling is not None:
            differ += [f"{field}.{name}={value!r} vs model.rope_scaling.{name}={getattr(scaling, name)!r}"
                       for name, value in _llama3_fields(rope, config).items() if value != getattr(scaling, name)]
    return differ


def _llama3_fields(rope: dict, config: dict) -> dict[str, object]:
    """A llama3 RoPE object's fields as transformers 5 reads them: original_max_position_embeddings from the
    top level when given there, else from the object, else config.json's max_position_embeddings."""
    values = {f.name: rope.get(f.name) for f in dataclasses.fields(RopeScaling) if f.name != "type"}
    context = "original_max_position_embeddings"
    values[context] = _first_given(config.get(context), values[context], config["max_position_embeddings"])
    return values


def _rope_setting(field: str, rope: dict) -> str:
    """A RoPE object's kind as config.json spells it, for messages."""
    spelling = next((key for key in ("rope_type", "type") if rope.get(key)), None)
    return f"{field}.{spelling}={rope[spelling]!r}" if spelling else f"{field}={rope or None!r}"


def _rope_kind(scaling: dict) -> str:
    """The RoPE variant a rope_scaling / rope_parameters object asks for, under either of the names
    transformers reads ("rope_type", or the older "type")."""
    return scaling.get("rope_type") or scaling.get("type") or "default"


def tensor_files(folder: Path) -> dict[str, Path]:
    """{HF tensor name: the safetensors file that holds it}. As transformers does, a single
    model.safetensors wins over an index of shards."""
    single = folder / "model.safetensors"
    if single.is_file():
        with open_safetensors(folder, single) as f:
            return {name: single for name in f.keys()}
    if not (folder / INDEX).is_file():
        raise ConfigError(f"{KEY}={folder}: neither model.safetensors nor {INDEX} is there")
    try:
        weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
    except (OSError, ValueError, RecursionError, KeyError, TypeError) as e:
        raise ConfigError(f"{KEY}={folder}: unreadable {INDEX} ({e!r})")
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ConfigError(f"{KEY}={folder}: {INDEX}'s weight_map is not an object of tensor name: file name")
    return {name: folder / file for name, file in weight_map.items()}


def context_note(config: dict, args: ModelArgs, folder: Path) -> str | None:
    """A line where seq_len is not the context the folder was trained for (its max_position_embeddings):
    past it, positions are trained that pretraining never saw (without RoPE scaling unless model.rope_scaling
    is set); short of it, an export declares only seq_len unless told the folder's context."""
    seq_len = args.max_seq_len
    context = config.get("max_position_embeddings", _LLAMA_DEFAULTS["max_position_embeddings"])
    if type(context) is not int or context == seq_len:
        return None
    if seq_len > context:
        unscaled = ", without RoPE scaling" if args.rope_scaling is None else ""
        return (f"{KEY}={folder}: seq_len={seq_len} is beyond its max_position_embeddings={context}: training "
                f"positions its pretraining never saw{unscaled}")
    return (f"{KEY}={folder}: seq_len={seq_len} is within its max_position_embeddings={context}; an export "
            f"declares {seq_len} unless given --max-position-embeddings {context}")
