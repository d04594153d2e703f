"""A whole model and its tokenizer, read in one process for inference (scripts/generate.py): from a
training checkpoint (a step_N folder, written under any parallel layout) or from a Hugging Face Llama
folder, told apart by their files.

A checkpoint gives its architecture in train_config.json, its weights through DCP's single-process load
and its tokenizer as the run read it. A Hugging Face folder gives the architecture in config.json (as
`model=hf` reads it), the weights mapped by model/hf.py's names and the tokenizer files it ships. Either
way the model is our Transformer with full weights, on one device, in eval mode.
"""

import dataclasses
import json
import warnings
from pathlib import Path

import torch

from model.args import ModelArgs
from model.hf import from_hf
from model.transformer import Transformer
from parallel.errors import ConfigError
from trainer.checkpoint.files import MANIFEST, checkpoint_files_problem, latest_checkpoint
from trainer.checkpoint.hf_folder import KEY, check_tensor_shapes, model_keys, read_hf_config
from trainer.checkpoint.hf_import import HFReader
from trainer.checkpoint.hf_origin import read_origin_config
from trainer.checkpoint.state import load_full_weights
from trainer.config.rules import check_model_config
from trainer.config.schema import TrainConfig, from_dict
from trainer.data.tokenizer import Tokenizer, load_tokenizer
from trainer.outputs import CHECKPOINTS_DIR, CONFIG_FILE

HF_CONFIG = "config.json"
HF_GENERATION_CONFIG = "generation_config.json"  # transformers' generate reads its eos ids there
CHECKPOINT, HF = "checkpoint", "Hugging Face folder"
Weights = dict[str, torch.Tensor]


def read_train_config(ckpt: Path) -> TrainConfig:
    """The run's config, saved next to the shards, checked as a model to build (the manifest vouches for
    the bytes the run wrote, not for a config edited and re-hashed since, or written by another version)."""
    path = ckpt / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint {ckpt} has no readable {CONFIG_FILE}: {e}")
    try:
        if not isinstance(raw, dict):
            raise ConfigError(f"holds a JSON {type(raw).__name__}, not the run's config")
        cfg = from_dict(raw)
        check_model_config(cfg)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    return cfg


def folder_kind(path: Path) -> str:
    """CHECKPOINT (it has the manifest a save writes last) or HF (a config.json); one line naming `path`
    when it is neither."""
    if (path / MANIFEST).is_file():
        return CHECKPOINT
    if (path / HF_CONFIG).is_file():
        return HF
    newest = latest_checkpoint(path / CHECKPOINTS_DIR) if path.is_dir() else None
    hint = f"; its newest complete checkpoint is {newest}" if newest else ""
    raise ConfigError(f"{path} is neither a checkpoint (a step_N folder with {MANIFEST}) nor a Hugging Face folder "
                      f"(with {HF_CONFIG}){hint}")


def load_model(path: Path, device: torch.device, dtype: torch.dtype) -> tuple[Transformer, Tokenizer]:
    """The model in `path` (a checkpoint or a Hugging Face folder) in `dtype` on `device`, and its tokenizer."""
    args, weights, tokenizer = (_from_checkpoint if folder_kind(path) == CHECKPOINT else _from_hf)(path)
    if tokenizer.vocab_size > args.vocab_size:
        raise ConfigError(f"{path}: its tokenizer has {tokenizer.vocab_size} ids, the model's vocabulary only "
                          f"{args.vocab_size}")
    # No fp8 GEMMs: their scaling state is a training matter, and the weights themselves are full precision.
    with torch.device("meta"):
        model = Transformer(dataclasses.replace(args, use_fp8=False))
    model.load_state_dict(weights, assign=True)
    return model.to(device, dtype).eval(), tokenizer


def stop_ids(path: Path, tokenizer: Tokenizer) -> list[int]:
    """The ids generation ends at: the tokenizer's eos, and each eos id the model's folder declares (an
    instruct model's list: Llama 3.1's end of turn and end of message beside the end of text), in a
    Hugging Face folder's config.json and generation_config.json, as transformers reads them, or in the
    config.json a checkpoint's run started from."""
    if folder_kind(path) == CHECKPOINT:
        configs = [read_origin_config(path) or {}]
    else:
        configs = [_json_object(path / name) for name in (HF_CONFIG, HF_GENERATION_CONFIG)]
    ids = [tokenizer.eos_id]
    for config in configs:
        declared = config.get("eos_token_id")
        for i in declared if isinstance(declared, list) else [declared]:
            if type(i) is int and 0 <= i < tokenizer.vocab_size and i not in ids:
                ids.append(i)
    return ids


def _json_object(path: Path) -> dict:
    """A JSON file's object; {} for a file that is missing, unreadable or holds something else."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def _from_checkpoint(path: Path) -> tuple[ModelArgs, Weights, Tokenizer]:
    # Sizes only: a sha256 pass would read every shard once more before DCP reads it.
    problem = checkpoint_files_problem(path, rank=0, world=1, checksums=False)
    if problem:
        raise ConfigError(problem)
    cfg = read_train_config(path)
    tokenizer = load_tokenizer(path, "checkpoint")
    with warnings.catch_warnings():
        # Single-process loading is the intent here, not an accident DCP should warn about.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        weights = load_full_weights(path, cfg)
    return cfg.model, weights, tokenizer


def _from_hf(folder: Path) -> tuple[ModelArgs, Weights, Tokenizer]:
    tokenizer = load_tokenizer(folder, "PATH")
    try:
        config = read_hf_config(folder)
        cfg = from_dict({"model": model_keys(config, folder)})
        check_model_config(cfg)
        args = cfg.model
        check_tensor_shapes(folder, args)
        weights = from_hf(HFReader(folder).tensor, args)
    except ConfigError as e:
        # hf_folder.py's lines name the folder by the training key they were written for; this one names it alone.
        raise ConfigError(f"{folder}: {str(e).removeprefix(f'{KEY}={folder}: ')}") from None
    return args, weights, tokenizer
