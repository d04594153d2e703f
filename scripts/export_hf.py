"""Export a training checkpoint as a Hugging Face Llama folder: config.json, the weights (model.safetensors,
or shards model-0000i-of-0000n.safetensors and model.safetensors.index.json), and the run's tokenizer in
its own format: a tokenizer.json with its tokenizer_config.json as the run read them, or a sentencepiece
tokenizer.model with the tokenizer_config.json transformers needs to give training's ids (transformers
reads it with `sentencepiece` and `protobuf` installed).

Evaluation harnesses and inference servers read Hugging Face's layout, not DCP shards. The export runs
as one plain process (no torchrun, no process group): the manifest is verified locally and DCP loads in
its single-process mode, one output shard's parameters at a time, so the process holds about one shard
(`--max-shard-size`, 5GB by default), not the model. Weights map by name (model/hf.py): fused q/k/v and
gate/up split into their parts, nothing permuted or reshaped. A padded vocabulary goes out without its
padding rows, at the tokenizer's size, unless a `checkpoint.init_from_hf` folder padded it itself: that
one goes back as it came (trainer/config/vocab.py), with the folder's list of eos ids where it had one
(the folder's config.json travels in the run's checkpoints: trainer/checkpoint/hf_origin.py).

    python scripts/export_hf.py CHECKPOINT_DIR OUT_DIR [--dtype fp32|bf16] [--no-tokenizer]
                                [--max-position-embeddings N] [--max-shard-size 5GB]
"""

import sys
from pathlib import Path

# Scripts run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import warnings  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import torch  # noqa: E402
from safetensors import SafetensorError  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from model.args import ModelArgs  # noqa: E402
from model.hf import hf_config, to_hf  # noqa: E402
from model.transformer import Transformer  # noqa: E402
from parallel.errors import ConfigError  # noqa: E402
from trainer.checkpoint.files import (MANIFEST, checkpoint_files_problem, enclosing_checkpoint,  # noqa: E402
                                     latest_checkpoint)
from trainer.checkpoint.hf_folder import INDEX  # noqa: E402
from trainer.checkpoint.hf_origin import exported_eos, read_origin_config  # noqa: E402
from trainer.checkpoint.model_folder import read_train_config  # noqa: E402
from trainer.checkpoint.state import load_full_weights  # noqa: E402
from trainer.config.schema import TrainConfig  # noqa: E402
from trainer.config.vocab import exported_vocab_size  # noqa: E402
from trainer.data.tokenizer import Tokenizer, load_tokenizer  # noqa: E402
from trainer.data.tokenizer_tiktoken import write_hf_files  # noqa: E402
from trainer.outputs import CHECKPOINTS_DIR  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
DEFAULT_SHARD_SIZE = "5GB"
_SIZE_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "B": 1}  # decimal, as transformers spells them


def parse_size(text: str) -> int:
    """Bytes of a size such as 5GB, 200KB or 1000000."""
    number, factor = text, 1
    for unit, unit_factor in _SIZE_UNITS.items():
        if text.upper().endswith(unit):
            number, factor = text[: -len(unit)], unit_factor
            break
    if not number.isdigit() or int(number) == 0:
        raise ConfigError(f"--max-shard-size={text} is not a positive size such as 5GB, 500MB or 200KB")
    return int(number) * factor


def shard_plan(args: ModelArgs, dtype: torch.dtype, max_bytes: int) -> list[list[str]]:
    """Our parameter names in model order, grouped into output shards of at most max_bytes in `dtype`
    (a larger parameter is a shard alone)."""
    with torch.device("meta"):
        params = list(Transformer(args).named_parameters())
    shards, size = [[]], 0
    for name, param in params:
        nbytes = param.numel() * dtype.itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def export(ckpt: Path, out: Path, dtype: torch.dtype, with_tokenizer: bool = True,
           max_positions: int | None = None, max_shard_bytes: int = parse_size(DEFAULT_SHARD_SIZE)) -> None:
    """Verify every file's sha256 first: DCP itself would load flipped bits without a word. The tokenizer
    is exported only where transformers gives training's ids (else an error, or with_tokenizer=False).
    config.json declares max_positions (default: the training seq_len) as the model's context."""
    if max_positions is not None and max_positions < 1:
        raise ConfigError(f"--max-position-embeddings={max_positions} must be a positive number of positions")
    if not (ckpt / MANIFEST).is_file():
        newest = latest_checkpoint(ckpt / CHECKPOINTS_DIR)
        hint = f"; its newest complete checkpoint is {newest}" if newest else ""
        raise ConfigError(f"{ckpt} is not a checkpoint (a step_N folder under dump_dir/checkpoints){hint}")
    if out.resolve() == Path.cwd().resolve():  # renamed over, the shell's folder would be a deleted one
        raise ConfigError(f"{out} is the current folder, which the export cannot replace: name a new or empty "
                          "folder other than the one you are in")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"{out} is not an empty folder: files left from another model (shards, an index) would "
                          "be read in place of the export; give a new or empty folder")
    inside = enclosing_checkpoint(out)
    if inside is not None:
        raise ConfigError(f"{out} is inside the checkpoint {inside} (it holds {MANIFEST}), whose files the manifest "
                          "vouches for; export to a folder outside it")
    problem = checkpoint_files_problem(ckpt, rank=0, world=1, checksums=True)
    if problem:
        raise ConfigError(problem)
    cfg = read_train_config(ckpt)
    tokenizer = load_tokenizer(ckpt, "checkpoint")
    origin = read_origin_config(ckpt)
    args = dataclasses.replace(cfg.model, vocab_size=exported_vocab_size(cfg, tokenizer.vocab_size, origin))
    difference = tokenization_difference(tokenizer) if with_tokenizer else None
    if difference:
        raise ConfigError(f"transformers' Llama tokenizer would give other ids than training for the run's "
                          f"tokenizer ({difference}); pass "
                          "--no-tokenizer to export the weights and config only")
    config = hf_config(args, _HF_DTYPE_NAMES[dtype], tokenizer.bos_id, exported_eos(origin, tokenizer.eos_id),
                       max_positions)
    with staged(out) as folder:
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_weights(ckpt, cfg, args, folder, dtype, shard_plan(args, dtype, max_shard_bytes))
        if with_tokenizer:
            write_tokenizer(tokenizer, folder)


@contextmanager
def staged(out: Path) -> Iterator[Path]:
    """A hidden folder beside `out` to write into, renamed to `out` once everything is written: an export
    that fails (a full disk) leaves nothing behind that a retry would refuse or transformers would read."""
    folder = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(folder, ignore_errors=True)  # one a killed export of this pid left
    folder.mkdir(parents=True)
    try:
        yield folder
        os.replace(folder, out)  # onto a missing or empty `out`
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise


def write_weights(ckpt: Path, cfg: TrainConfig, args: ModelArgs, out: Path, dtype: torch.dtype,
                  shards: list[list[str]]) -> None:
    """Each output shard from its own load, so only one shard's parameters are in memory at a time;
    one shard is model.safetensors, several are numbered and listed in the index. `args`: the exported
    model (the checkpoint's, its vocabulary without the padding rows an export drops)."""
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map, total = {}, 0
    for names, file in zip(shards, files):
        with warnings.catch_warnings():
            # Single-process loading is the intent here, not an accident DCP should warn about.
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            weights = load_full_weights(ckpt, cfg, names)
        tensors = {n: t.to(dtype).contiguous() for n, t in to_hf(weights, args).items()}
        del weights
        save_file(tensors, out / file, metadata={"format": "pt"})
        # safetensors writes through a private temp file (mode 0600); give it the mode the umask gave config.json.
        shutil.copymode(out / "config.json", out / file)
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")


# Text on which a sentencepiece normalizer other than the identity (sentencepiece's default NFKC, with
# runs of whitespace collapsed) changes what transformers' Llama tokenizer, which only turns spaces into
# "\u2581" (and prefixes one where the model does), hands to the segmenter.
NORMALIZATION_PROBES = ("a\n    b", "x  y", "trail ", "\uff46\uff55\uff4c\uff4c", "\ufb01", "e\u0301")


def tokenization_difference(tokenizer: Tokenizer) -> str | None:
    """Where transformers would tokenize text otherwise than training did (None: nowhere probed)."""
    if tokenizer.kind != "sentencepiece":
        return None  # its own files, and for tiktoken the tokenizer.json transformers converts from them
    if tokenizer.model_type != "bpe":
        return (f"the model is a sentencepiece {tokenizer.model_type} model: transformers' Llama tokenizer "
                "segments text as BPE, into other tokens")
    if not tokenizer.has_byte_fallback:
        return ("the model has no byte fallback: text outside its vocabulary is <unk> for training, and "
                "transformers drops it")
    prefix = "\u2581" if tokenizer.adds_prefix_space else ""
    for text in NORMALIZATION_PROBES:
        ours, theirs = tokenizer.normalize(text), prefix + text.replace(" ", "\u2581")
        if ours != theirs:
            return f"{text!r} is normalized to {ours!r} for training, to {theirs!r} by transformers"
    return None


def write_tokenizer(tokenizer: Tokenizer, out: Path) -> None:
    """A Hugging Face tokenizer's files as the run read them; a tiktoken file in original/, with the
    tokenizer.json transformers converts from it. A sentencepiece model's tokenizer.model, and
    how transformers must read it to give training's ids: the run tokenizer's own
    bos first (packing puts one before every document), no eos appended, a space prefixed only where the
    model itself adds one (the BPE trained here does not). Special tokens are named by the model's own
    pieces: a sentencepiece model given in data.tokenizer may number and name them otherwise than ours.
    Their text inside a document ("</s>" in code) is ordinary characters to training, and so to
    transformers with split_special_tokens (else it would become the control token).
    One difference transformers keeps for a model that adds a prefix space: text that itself begins
    with whitespace (or with "\u2581", sentencepiece's space symbol) tokenizes differently there
    (documents rarely do; ours adds none)."""
    if tokenizer.kind == "huggingface":
        for name, data in tokenizer.files.items():
            (out / name).write_bytes(data)
        return
    if tokenizer.kind == "tiktoken":  # where Llama 3 folders keep it, and the tokenizer.json made from it
        ranks = out / "original" / "tokenizer.model"
        ranks.parent.mkdir(exist_ok=True)
        ranks.write_bytes(tokenizer.model_bytes)
        write_hf_files(ranks, out)
        return
    (out / "tokenizer.model").write_bytes(tokenizer.model_bytes)
    config = {
        "tokenizer_class": "LlamaTokenizer", "add_bos_token": True, "add_eos_token": False,
        "bos_token": tokenizer.piece(tokenizer.bos_id), "eos_token": tokenizer.piece(tokenizer.eos_id),
        "unk_token": tokenizer.piece(tokenizer.unk_id), "legacy": False,
        "add_prefix_space": tokenizer.adds_prefix_space, "split_special_tokens": True,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


DESCRIPTION = ("Export a training checkpoint as a Hugging Face Llama folder: config.json, the weights "
               "(safetensors, sharded past --max-shard-size) and the run's tokenizer.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=DESCRIPTION)
    parser.add_argument("checkpoint", type=Path, help="a step_N folder under {dump_dir}/checkpoints")
    parser.add_argument("out", type=Path, help="a new or empty folder to write the Hugging Face model into")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                        help="the dtype of the exported weights (default: fp32)")
    parser.add_argument("--no-tokenizer", action="store_true",
                        help="leave the tokenizer files out (for a tokenizer transformers would read otherwise)")
    parser.add_argument("--max-position-embeddings", type=int, metavar="N",
                        help="the context config.json declares (default: the training seq_len); e.g. that of "
                             "the checkpoint.init_from_hf folder, for a run trained at a shorter seq_len")
    parser.add_argument("--max-shard-size", default=DEFAULT_SHARD_SIZE, metavar="SIZE",
                        help="the most bytes of one weights file (and about what the export holds in memory)")
    opts = parser.parse_args(argv)
    try:
        export(opts.checkpoint, opts.out, DTYPES[opts.dtype], with_tokenizer=not opts.no_tokenizer,
               max_positions=opts.max_position_embeddings, max_shard_bytes=parse_size(opts.max_shard_size))
    except (ConfigError, OSError, SafetensorError) as e:  # OSError, SafetensorError: an unwritable OUT_DIR, a full disk
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    print(f"exported {opts.checkpoint} to {opts.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
