"""The model's vocabulary against the tokenizer's: the rules that need the tokenizer, so are applied as the
data is prepared, not with the static ones.

A model may have more rows than its tokenizer has ids, never fewer; the rows past the ids are padding.
`make_vocab_size_divisible_by=N` pads as Megatron does: the tokenizer's size rounded up to a multiple of
N x model_parallel_size, so the vocabulary splits evenly over tensor parallelism. The data path checks
the sizes before it packs anything (a given tokenizer; one trained on the data has model.vocab_size ids);
the trainer then builds the model from `with_tokenizer_vocabulary`'s config, whose model.vocab_size is the
model's rows and model.valid_vocab_size the tokenizer's ids.
"""

import dataclasses
from typing import NamedTuple

from parallel.errors import ConfigError
from trainer.config.schema import TrainConfig


class VocabPadding(NamedTuple):
    divisible_by: int  # make_vocab_size_divisible_by
    tp: int  # model_parallel_size

    def pad(self, ids: int) -> int:
        """`ids` rounded up to a multiple of divisible_by x tp."""
        multiple = self.divisible_by * self.tp
        return -(-ids // multiple) * multiple


def vocab_padding(cfg: TrainConfig) -> VocabPadding | None:
    """The run's padding rule; None: model.vocab_size is the model's vocabulary as configured."""
    by = cfg.make_vocab_size_divisible_by
    return None if by is None else VocabPadding(by, cfg.model_parallel_size)


def model_vocab_size(configured: int, ids: int, padding: VocabPadding | None, where: str) -> int:
    """The model's vocabulary size for a tokenizer of `ids` ids (`where` names it), or one ConfigError line.
    model.vocab_size (`configured`) is at least `ids`. Padding rounds `ids` up, and model.vocab_size may
    state the tokenizer's size (as model files do, and as a tokenizer trained on the data gets) or the
    padded size, nothing else."""
    if configured < ids:
        raise ConfigError(f"model.vocab_size={configured} is below the tokenizer's vocabulary size {ids} ({where}): "
                          "the model needs a row for every token id (more rows are padding)")
    if padding is None:
        return configured
    padded = padding.pad(ids)
    if configured not in (ids, padded):
        raise ConfigError(
            f"model.vocab_size={configured} disagrees with make_vocab_size_divisible_by={padding.divisible_by}, which "
            f"pads the tokenizer's {ids} ids ({where}) to {padded}, a multiple of it x model_parallel_size="
            f"{padding.tp}: set model.vocab_size={ids} (or {padded}), or make_vocab_size_divisible_by=null")
    return padded


def with_tokenizer_vocabulary(cfg: TrainConfig, ids: int, where: str) -> TrainConfig:
    """`cfg` with the model's vocabulary as a tokenizer of `ids` ids fixes it: model.vocab_size the model's
    rows (padded under make_vocab_size_divisible_by), model.valid_vocab_size the tokenizer's ids."""
    size = model_vocab_size(cfg.model.vocab_size, ids, vocab_padding(cfg), where)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=size, valid_vocab_size=ids))


def planned_vocabulary(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with the vocabulary the trainer will build, where no tokenizer is at hand (a plan):
    model.vocab_size stands for the tokenizer's ids (or is the padded size already), padded under
    make_vocab_size_divisible_by to a multiple of it x this layout's model_parallel_size."""
    if vocab_padding(cfg) is None or cfg.model.valid_vocab_size is not None:
        return cfg
    return with_tokenizer_vocabulary(cfg, cfg.model.vocab_size, "model.vocab_size")


def exported_vocab_size(cfg: TrainConfig, ids: int, origin: dict | None = None) -> int:
    """The vocabulary an export writes, of a run whose tokenizer has `ids` ids: those, the padding dropped,
    except for a run started from a Hugging Face folder: the folder's own vocab_size (`origin`: its config.json
    as the checkpoint carries it), so that a round trip gives the folder back, also after a resume that
    kept a padded size with make_vocab_size_divisible_by=null. A checkpoint that carries no origin (saved
    before checkpoints did) falls back on the config: started from a folder without the key, model.vocab_size
    is the folder's (hf_folder.check_architecture; the key pads only a folder of the tokenizer's size:
    hf_folder.check_vocab)."""
    if origin is not None and type(origin.get("vocab_size")) is int:
        return origin["vocab_size"]
    if cfg.checkpoint.init_from_hf is not None and cfg.make_vocab_size_divisible_by is None:
        return cfg.model.vocab_size
    return ids
