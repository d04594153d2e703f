"""A padded vocabulary in the config (trainer/config/vocab.py): make_vocab_size_divisible_by and
model.vocab_size against the tokenizer's size, each refusal one line; the static rules; what a resume
compares; what a Hugging Face folder may be, and what an export writes."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from model.args import ModelArgs
from model.hf import hf_config, to_hf
from model.transformer import Transformer
from parallel.errors import ConfigError
from tests.unit.trainer.config.test_config import load
from trainer.checkpoint.fingerprint import config_fingerprint
from trainer.checkpoint.hf_folder import check_architecture, check_vocab
from trainer.config.rules import validate
from trainer.config.vocab import (VocabPadding, exported_vocab_size, model_vocab_size, vocab_padding,
                                  with_tokenizer_vocabulary)


def test_the_key_rounds_the_tokenizers_size_up_to_a_multiple_of_it_times_tp():
    padding = VocabPadding(divisible_by=128, tp=8)
    assert model_vocab_size(50257, 50257, padding, "t") == 51200  # a model file states the tokenizer's size
    assert model_vocab_size(51200, 50257, padding, "t") == 51200  # or the padded size itself
    assert model_vocab_size(51200, 51200, padding, "t") == 51200  # already a multiple: nothing to pad
    assert model_vocab_size(50300, 50257, None, "t") == 50300  # without the key: model.vocab_size, padded by hand


def test_below_the_tokenizer_and_a_disagreeing_vocab_size_are_one_line():
    for padding in (None, VocabPadding(64, 2)):
        with pytest.raises(ConfigError, match=r"^model.vocab_size=499 is below the tokenizer's vocabulary size 500 "
                                              r"\(data.tokenizer=t.json\): [^\n]*$"):
            model_vocab_size(499, 500, padding, "data.tokenizer=t.json")
    with pytest.raises(ConfigError, match=r"^model.vocab_size=1000 disagrees with make_vocab_size_divisible_by=64, "
                                          r"which pads the tokenizer's 500 ids \(t.json\) to 512, a multiple of it x "
                                          r"model_parallel_size=2: set model.vocab_size=500 \(or 512\), or "
                                          r"make_vocab_size_divisible_by=null$"):
        model_vocab_size(1000, 500, VocabPadding(64, 2), "t.json")


def test_the_tokenizer_fixes_the_models_rows_and_ids():
    cfg = load("make_vocab_size_divisible_by=64", "model_parallel_size=2", "model.vocab_size=500")
    assert vocab_padding(cfg) == (64, 2) and vocab_padding(load()) is None
    padded = with_tokenizer_vocabulary(cfg, 500, "t")
    assert (padded.model.vocab_size, padded.model.valid_vocab_size, padded.model.max_seq_len) == (512, 500, 128)
    unpadded = with_tokenizer_vocabulary(load(), 512, "t")
    assert (unpadded.model.vocab_size, unpadded.model.valid_vocab_size) == (512, 512)


def test_the_static_rules_leave_a_vocabulary_the_key_pads_to_it():
    """Without the key model.vocab_size splits over TP; with it, the padded size does by construction."""
    validate(load("make_vocab_size_divisible_by=64", "model_parallel_size=2", "model.vocab_size=501"), 2)
    with pytest.raises(ConfigError, match=r"^model.vocab_size=501 is not divisible by model_parallel_size=2: pad it "
                                          r"\(make_vocab_size_divisible_by, or a larger model.vocab_size\)$"):
        validate(load("model_parallel_size=2", "model.vocab_size=501"), 2)
    with pytest.raises(ConfigError, match=r"^make_vocab_size_divisible_by=0 must be > 0"):
        validate(load("make_vocab_size_divisible_by=0"), 1)


def test_a_resume_compares_the_padded_vocabulary_once_the_tokenizer_is_known():
    """Before the data (the early check) the key's vocabulary is unknown, and left out; then it is the
    padded size, which the key itself is no part of."""
    cfg = load("make_vocab_size_divisible_by=64", "model.vocab_size=500")
    assert "model.vocab_size" not in config_fingerprint(cfg, "fp32", 4)
    assert config_fingerprint(with_tokenizer_vocabulary(cfg, 500, "t"), "fp32", 4)["model.vocab_size"] == 512
    by_hand = with_tokenizer_vocabulary(load("model.vocab_size=512"), 500, "t")
    assert config_fingerprint(by_hand, "fp32", 4) == config_fingerprint(with_tokenizer_vocabulary(cfg, 500, "t"),
                                                                         "fp32", 4)


def test_an_export_drops_the_padding_but_keeps_a_folders_own():
    run = with_tokenizer_vocabulary(load("make_vocab_size_divisible_by=64", "model.vocab_size=500"), 500, "t")
    assert exported_vocab_size(run, 500) == 500
    imported = dataclasses.replace(run, checkpoint=dataclasses.replace(run.checkpoint, init_from_hf="/hf"))
    assert exported_vocab_size(imported, 500) == 500  # the key padded a folder of the tokenizer's size
    folder_padded = dataclasses.replace(imported, make_vocab_size_divisible_by=None)
    assert exported_vocab_size(folder_padded, 500) == 512  # the folder's own vocab_size: a round trip keeps it


def test_an_export_of_an_import_writes_the_folders_vocabulary_after_any_resume(tmp_path):
    """The folder's config.json, carried by the run's checkpoints, decides: a run padded by the key (tp2: 512)
    and resumed on tp4 as the refusal says (make_vocab_size_divisible_by=null model.vocab_size=512) reads as
    a folder that padded itself from its config alone, and would export its zero padding rows as ids."""
    padded = with_tokenizer_vocabulary(load("make_vocab_size_divisible_by=256", "model_parallel_size=2"), 500, "t")
    started = dataclasses.replace(padded, checkpoint=dataclasses.replace(padded.checkpoint, init_from_hf="/hf"))
    resumed = dataclasses.replace(started, make_vocab_size_divisible_by=None)
    assert started.model.vocab_size == resumed.model.vocab_size == 512
    folder = {"vocab_size": 500}
    assert exported_vocab_size(started, 500, folder) == exported_vocab_size(resumed, 500, folder) == 500
    assert exported_vocab_size(resumed, 500) == 512  # without the carried config: the config's reading
    assert exported_vocab_size(resumed, 500, {"vocab_size": 512}) == 512  # a folder padded by its makers


def test_an_exports_tensors_leave_the_padding_rows_out():
    padded = ModelArgs(vocab_size=640, valid_vocab_size=512)
    weights = {name: torch.randn(param.shape) for name, param in Transformer(padded).named_parameters()}
    exported = to_hf(weights, dataclasses.replace(padded, vocab_size=512))
    assert torch.equal(exported["lm_head.weight"], weights["head.output.weight"][:512])
    assert torch.equal(exported["model.embed_tokens.weight"], weights["tok_embeddings.weight"][:512])


def test_a_folder_may_be_the_padded_models_tokenizer_size_and_the_key_pads_only_that(tmp_path):
    config = hf_config(ModelArgs(), "float32", 1, 2)  # vocab_size 512
    check_architecture(config, ModelArgs(vocab_size=640, valid_vocab_size=512), tmp_path)
    with pytest.raises(ConfigError, match="vocab_size=512 vs model.vocab_size=640"):
        check_architecture(config, ModelArgs(vocab_size=640), tmp_path)
    tokenizer = SimpleNamespace(vocab_size=500, path="tokenizer.model")
    check_vocab(config, tokenizer, tmp_path, padded=False)  # a folder padded by its makers imports as it is
    check_vocab(config | {"vocab_size": 500}, tokenizer, tmp_path, padded=True)
    with pytest.raises(ConfigError, match=rf"^checkpoint.init_from_hf={tmp_path}: config.json's vocab_size=512 "
                                          r"already pads its tokenizer's 500 ids \(tokenizer.model\); "
                                          r"make_vocab_size_divisible_by pads only [^\n]*null to keep the folder's$"):
        check_vocab(config, tokenizer, tmp_path, padded=True)
