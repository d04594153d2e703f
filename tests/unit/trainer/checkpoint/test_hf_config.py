"""What checkpoint.init_from_hf reads from a Hugging Face folder's config.json: rope_theta and Llama 3.1's
RoPE scaling under each spelling transformers reads, as the installed transformers computes them, or one
error line; the context it was trained for (max_position_embeddings), against seq_len; the RoPE
scaling an export writes; and its token ids, against the tokenizer's."""

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import transformers

from model.args import ModelArgs, RopeScaling
from model.hf import hf_config
from parallel.errors import ConfigError
from trainer.checkpoint.hf_folder import check_architecture, check_token_ids, context_note, model_keys

THETA = 500000.0  # Llama 3's, not the 1e4 default: a spelling read wrong imports as 1e4
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
SCALED = dataclasses.replace(ModelArgs(), rope_theta=THETA, rope_scaling=RopeScaling())  # Llama 3.1's RoPE


def llama_config(**rope) -> dict:
    """config.json of ModelArgs' architecture with rope_theta given only as `rope` spells it."""
    config = {k: v for k, v in hf_config(ModelArgs(), "float32", 1, 2).items() if k != "rope_theta"}
    return config | rope


def transformers_rope(config: dict, folder: Path) -> dict:
    """The RoPE parameters transformers computes with from `config` (rope_theta, rope_type, llama3's fields)."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return transformers.AutoConfig.from_pretrained(folder).rope_parameters


def transformers_theta(config: dict, folder: Path) -> float:
    return transformers_rope(config, folder)["rope_theta"]


@pytest.mark.parametrize("rope", [
    {"rope_scaling": {"rope_type": "default", "rope_theta": THETA}},
    {"rope_parameters": {"rope_type": "default", "rope_theta": THETA}},
    {"rope_theta": THETA, "rope_scaling": {"rope_type": "default"}},
    {"rope_theta": THETA, "rope_scaling": {"type": "default", "rope_theta": THETA},
     "rope_parameters": {"type": "default", "rope_theta": THETA}},
], ids=["rope_scaling", "rope_parameters", "top_level", "all_agree"])
def test_rope_theta_imports_as_transformers_reads_it(tmp_path: Path, rope: dict) -> None:
    config = llama_config(**rope)
    assert transformers_theta(config, tmp_path / "hf") == THETA
    check_architecture(config, dataclasses.replace(ModelArgs(), rope_theta=THETA), tmp_path)
    with pytest.raises(ConfigError, match=f"rope_theta={THETA!r} vs model.rope_theta=10000.0"):
        check_architecture(config, ModelArgs(), tmp_path)


@pytest.mark.parametrize("rope, fragment", [
    # transformers 5 takes rope_scaling whole and never sees rope_parameters' theta: it computes 1e4.
    ({"rope_scaling": {"rope_type": "default"}, "rope_parameters": {"rope_type": "default", "rope_theta": THETA}},
     "rope_scaling gives rope_theta=10000.0, its rope_parameters 500000.0 (transformers 5 reads only rope_scaling)"),
    # transformers 4 reads the top level's, 5 the nested one.
    ({"rope_theta": 10000.0, "rope_scaling": {"rope_type": "default", "rope_theta": THETA}},
     "rope_theta=10000.0 and rope_scaling.rope_theta=500000.0"),
    ({"rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": THETA}},
     "rope_theta=10000.0 and rope_parameters.rope_theta=500000.0"),
], ids=["scaling_vs_parameters", "top_vs_scaling", "top_vs_parameters"])
def test_rope_theta_spellings_that_disagree_are_one_line(tmp_path: Path, rope: dict, fragment: str) -> None:
    for theta in (10000.0, THETA):  # whichever the model has: some transformers version computes the other
        with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")) as e:
            check_architecture(llama_config(**rope), dataclasses.replace(ModelArgs(), rope_theta=theta), tmp_path)
        assert str(e.value).startswith(f"checkpoint.init_from_hf={tmp_path}: ") and "\n" not in str(e.value)


def test_model_keys_take_the_rope_transformers_reads_and_refuse_two_that_differ(tmp_path: Path) -> None:
    """model=hf and generate.py build the model from model_keys: with rope_scaling and rope_parameters both
    given, transformers 5 reads rope_scaling alone; where they describe other RoPEs it was llama3 from
    whichever had it (other logits than transformers'), now one line."""
    scaled = llama_config(rope_theta=THETA, rope_scaling={"rope_type": "llama3", **LLAMA3},
                          rope_parameters={"rope_type": "llama3", "rope_theta": THETA, **LLAMA3})
    assert model_keys(scaled, tmp_path)["rope_scaling"] == {"type": "llama3", **LLAMA3}
    assert model_keys(llama_config(rope_parameters={"rope_type": "llama3", "rope_theta": THETA, **LLAMA3}),
                      tmp_path)["rope_scaling"] == {"type": "llama3", **LLAMA3}
    plain = llama_config(rope_theta=THETA, rope_scaling={"rope_type": "default"},
                         rope_parameters={"rope_type": "llama3", "rope_theta": THETA, **LLAMA3})
    assert transformers_rope(plain, tmp_path / "hf")["rope_type"] == "default"
    with pytest.raises(ConfigError, match=r"config.json's rope_scaling describes the default RoPE, its rope_parameters "
                                          r"\{'type': 'llama3', 'factor': 8.0, .*\} \(transformers 5 reads only "
                                          r"rope_scaling\): make them agree or drop one$"):
        model_keys(plain, tmp_path)


def seq(seq_len: int, args: ModelArgs = ModelArgs()) -> ModelArgs:
    return dataclasses.replace(args, max_seq_len=seq_len)


def test_a_seq_len_other_than_the_folders_context_is_one_log_line(tmp_path: Path) -> None:
    config = llama_config() | {"max_position_embeddings": 8192}
    assert context_note(config, seq(8192), tmp_path) is None
    longer = context_note(config, seq(16384), tmp_path)
    assert longer.startswith(f"checkpoint.init_from_hf={tmp_path}: seq_len=16384 is beyond its "
                             "max_position_embeddings=8192") and "without RoPE scaling" in longer
    scaled = context_note(config, seq(16384, SCALED), tmp_path)
    assert "seq_len=16384 is beyond its max_position_embeddings=8192" in scaled and "RoPE scaling" not in scaled
    shorter = context_note(config, seq(2048), tmp_path)
    assert "seq_len=2048 is within its max_position_embeddings=8192" in shorter
    assert shorter.endswith("--max-position-embeddings 8192")  # what the export needs to declare it
    # Left out of config.json: transformers' default.
    default = transformers.LlamaConfig().max_position_embeddings
    assert f"max_position_embeddings={default}" in context_note({}, seq(2 * default), tmp_path)


@pytest.mark.parametrize("rope", [
    {"rope_theta": THETA, "rope_scaling": {"rope_type": "llama3", **LLAMA3}},  # Llama 3.1's own config.json
    {"rope_theta": THETA, "rope_scaling": {"type": "llama3", **LLAMA3}},  # the older spelling
    {"rope_parameters": {"rope_type": "llama3", "rope_theta": THETA, **LLAMA3}},  # as transformers 5 saves it
    # Left out, transformers 5 takes the context from max_position_embeddings.
    {"rope_theta": THETA, "max_position_embeddings": 8192,
     "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}},
], ids=["rope_scaling", "type", "rope_parameters", "context_left_out"])
def test_llama3_scaling_imports_where_it_matches_the_model(tmp_path: Path, rope: dict) -> None:
    config = llama_config(**rope)
    parameters = transformers_rope(config, tmp_path / "hf")
    assert parameters["rope_type"] == "llama3" and {k: parameters[k] for k in LLAMA3} == LLAMA3
    check_architecture(config, SCALED, tmp_path)
    field = next(iter(set(rope) - {"rope_theta", "max_position_embeddings"}))
    spelling = "type" if "type" in rope[field] else "rope_type"
    for scaling, fragment in (
        (RopeScaling(factor=32.0), f"{field}.factor=8.0 vs model.rope_scaling.factor=32.0"),
        (RopeScaling(original_max_position_embeddings=4096),
         f"{field}.original_max_position_embeddings=8192 vs model.rope_scaling.original_max_position_embeddings=4096"),
        (None, f"{field}.{spelling}='llama3' vs model.rope_scaling=None"),
    ):
        args = dataclasses.replace(SCALED, rope_scaling=scaling)
        with pytest.raises(ConfigError, match=fragment) as e:
            check_architecture(config, args, tmp_path)
        assert str(e.value).startswith(f"checkpoint.init_from_hf={tmp_path}: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("rope, fragment", [
    ({"rope_theta": THETA}, "rope_scaling=None vs model.rope_scaling.type='llama3'"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": THETA}},
     "rope_parameters.rope_type='default' vs model.rope_scaling.type='llama3'"),
], ids=["none", "default"])
def test_a_scaled_model_refuses_an_unscaled_folder(tmp_path: Path, rope: dict, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment) as e:
        check_architecture(llama_config(**rope), SCALED, tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("field", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("kind", ["yarn", "dynamic"])
def test_another_rope_type_is_refused_in_one_line(tmp_path: Path, field: str, kind: str) -> None:
    config = llama_config(rope_theta=THETA, **{field: {"type": kind, "factor": 8.0}})
    for args in (SCALED, dataclasses.replace(SCALED, rope_scaling=None)):
        with pytest.raises(ConfigError, match=f"config.json's {field} asks for '{kind}' RoPE scaling; this model "
                                              "supports only the default RoPE or 'llama3'") as e:
            check_architecture(config, args, tmp_path)
        assert "\n" not in str(e.value)


@pytest.mark.parametrize("args", [SCALED, dataclasses.replace(SCALED, rope_scaling=None)], ids=["llama3", "none"])
def test_the_exported_rope_is_what_transformers_reads_and_imports_back(tmp_path: Path, args: ModelArgs) -> None:
    config = hf_config(args, "float32", 1, 2)
    parameters = transformers_rope(config, tmp_path / "hf")
    if args.rope_scaling is None:
        assert "rope_scaling" not in config and parameters["rope_type"] == "default"
    else:
        assert config["rope_scaling"] == {"rope_type": "llama3", **LLAMA3}
        assert parameters["rope_type"] == "llama3" and {k: parameters[k] for k in LLAMA3} == LLAMA3
    assert parameters["rope_theta"] == THETA
    check_architecture(config, args, tmp_path)


@pytest.mark.parametrize("tied", [True, False])
def test_tied_embeddings_export_as_transformers_reads_them_and_must_match_on_import(tmp_path: Path, tied: bool) -> None:
    args = dataclasses.replace(ModelArgs(), tie_embeddings=tied)
    config = hf_config(args, "float32", 1, 2)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    assert transformers.AutoConfig.from_pretrained(folder).tie_word_embeddings is tied
    check_architecture(config, args, tmp_path)
    with pytest.raises(ConfigError, match=f"tie_word_embeddings={tied} vs model.tie_embeddings={not tied}") as e:
        check_architecture(config, dataclasses.replace(args, tie_embeddings=not tied), tmp_path)
    assert "\n" not in str(e.value)


def test_token_ids_of_config_json_must_be_the_tokenizers(tmp_path: Path) -> None:
    """A folder saying bos=998 would otherwise train with a tokenizer whose bos is 1, without a word."""
    tokenizer = SimpleNamespace(bos_id=1, eos_id=2, path=tmp_path / "tokenizer.json")
    check_token_ids({"bos_token_id": 1, "eos_token_id": 2}, tokenizer, tmp_path)
    check_token_ids({"bos_token_id": 1, "eos_token_id": [7, 2]}, tokenizer, tmp_path)  # instruct: several eos
    check_token_ids({}, tokenizer, tmp_path)  # not stated: nothing to compare
    with pytest.raises(ConfigError, match=rf"^checkpoint.init_from_hf={tmp_path}: config.json's bos_token_id=998 is "
                                          rf"not the id of the tokenizer's bos token \({tmp_path}/tokenizer.json: 1\)$"):
        check_token_ids({"bos_token_id": 998, "eos_token_id": 2}, tokenizer, tmp_path)
    with pytest.raises(ConfigError, match=r"config.json's eos_token_id=\[7, 8\] is not the id of the tokenizer's eos"):
        check_token_ids({"bos_token_id": 1, "eos_token_id": [7, 8]}, tokenizer, tmp_path)
