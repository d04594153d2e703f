"""model=hf: the architecture of checkpoint.init_from_hf's config.json fills conf/model/hf.yaml's `???` keys,
a command-line key that contradicts the folder is one line naming both values, and a resume whose
folder is gone takes the architecture its checkpoint saved."""

import dataclasses
import json
from pathlib import Path

import pytest
import yaml

from parallel.errors import ConfigError
from tests import REPO
from trainer.config.hf_model import fill_hf_model
from trainer.config.schema import from_dict

LLAMA31 = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 584, "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "max_position_embeddings": 128,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 16}}


def values(folder: Path | None, **model) -> dict:
    """The resolved config of `model=hf` as hydra hands it over, with `model` overrides."""
    hf = yaml.safe_load((REPO / "conf" / "model" / "hf.yaml").read_text())
    return {"dump_dir": str(folder.parent / "run") if folder else "run", "model": hf | model,
            "checkpoint": {"init_from_hf": str(folder) if folder else None}}


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps(LLAMA31))
    return tmp_path / "hf"


def test_the_architecture_is_the_folders(folder):
    cfg = from_dict(fill_hf_model(values(folder)))
    m = cfg.model
    assert (m.n_layers, m.dim, m.n_heads, m.n_kv_heads, m.vocab_size, m.ffn_hidden_dim, m.norm_eps, m.rope_theta) == \
        (2, 64, 4, 2, 584, 160, 1e-5, 500000.0)
    assert (m.rope_scaling.factor, m.rope_scaling.original_max_position_embeddings) == (8.0, 16)
    assert from_dict(fill_hf_model(values(folder, n_layers=2))).model == m  # agreeing with the folder is fine
    assert not m.tie_embeddings  # transformers' default where config.json is silent


def test_tied_embeddings_are_the_folders(folder):
    (folder / "config.json").write_text(json.dumps(LLAMA31 | {"tie_word_embeddings": True}))
    assert from_dict(fill_hf_model(values(folder))).model.tie_embeddings
    with pytest.raises(ConfigError, match=r"^model.tie_embeddings=False contradicts .*config.json, which gives True$"):
        fill_hf_model(values(folder, tie_embeddings=False))


def test_a_key_that_contradicts_the_folder_is_one_line(folder):
    with pytest.raises(ConfigError, match=rf"^model.n_layers=4 contradicts checkpoint.init_from_hf={folder}'s "
                                          r"config.json, which gives 2$"):
        fill_hf_model(values(folder, n_layers=4))
    with pytest.raises(ConfigError, match=r"^model=hf takes the architecture from checkpoint.init_from_hf's "
                                          r"config.json: set checkpoint.init_from_hf=PATH$"):
        fill_hf_model(values(None))


def test_a_resume_whose_folder_is_gone_takes_the_checkpoints_architecture(folder):
    saved = from_dict(fill_hf_model(values(folder)))
    checkpoint = folder.parent / "run" / "checkpoints" / "step_3"
    checkpoint.mkdir(parents=True)
    (checkpoint / "manifest.json").write_text("{}")
    (checkpoint / "train_config.json").write_text(json.dumps(dataclasses.asdict(saved)))
    (folder / "config.json").unlink()
    assert from_dict(fill_hf_model(values(folder))).model == saved.model
    with pytest.raises(ConfigError, match=r"^model.dim=128 contradicts the resumed checkpoint .*step_3, which gives 64$"):
        fill_hf_model(values(folder, dim=128))


def test_other_models_pass_unchanged():
    raw = {"model": {"name": "tiny", "n_layers": 2}, "checkpoint": {"init_from_hf": None}}
    assert fill_hf_model(raw) == {"model": {"name": "tiny", "n_layers": 2}, "checkpoint": {"init_from_hf": None}}
