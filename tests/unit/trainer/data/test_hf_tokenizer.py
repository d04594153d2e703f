"""The tokenizer of a run started from checkpoint.init_from_hf: the folder's tokenizer.model, the same
model named in data.tokenizer, or one error line; a resume keeps the tokenizer it trained with."""

from pathlib import Path

import pytest

from parallel.errors import ConfigError
from trainer.data.tokenizer import choose_tokenizer


def folder_with_tokenizer(tmp_path: Path, model: bytes) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(model)
    return folder


def test_data_tokenizer_other_than_the_folders_is_refused_at_start(tmp_path: Path) -> None:
    folder = folder_with_tokenizer(tmp_path, b"the folder's sentencepiece model")
    other = tmp_path / "other.model"
    other.write_bytes(b"another sentencepiece model")
    with pytest.raises(ConfigError) as e:
        choose_tokenizer(str(other), str(folder), resumed=None)
    line = str(e.value)
    assert f"data.tokenizer={other} " in line and str(folder / "tokenizer.model") in line, line
    assert "set data.tokenizer=null to use the folder's" in line and "\n" not in line
    # The weights of a resume come from its checkpoint, trained with data.tokenizer all along.
    assert choose_tokenizer(str(other), str(folder), resumed=tmp_path / "step_2").path == str(other)


def test_the_folders_tokenizer_named_again_or_left_out_is_used(tmp_path: Path) -> None:
    folder = folder_with_tokenizer(tmp_path, b"the folder's sentencepiece model")
    copy = tmp_path / "copy.model"
    copy.write_bytes(b"the folder's sentencepiece model")
    assert choose_tokenizer(str(copy), str(folder), resumed=None).path == str(copy)
    assert choose_tokenizer(None, str(folder), resumed=None).path == str(folder / "tokenizer.model")
    assert choose_tokenizer(None, None, resumed=None).path is None  # no folder: a tokenizer is trained on the data


def test_a_folder_without_tokenizer_needs_data_tokenizer(tmp_path: Path) -> None:
    """The weights' ids are unknown: data.tokenizer must name them, never a newly trained tokenizer."""
    with pytest.raises(ConfigError, match="hf has no tokenizer.json or tokenizer.model or original/tokenizer.model: "
                                          "set data.tokenizer to the tokenizer its weights were trained with"):
        choose_tokenizer(None, str(tmp_path / "hf"), resumed=None)
    assert choose_tokenizer("/tok/spm.model", str(tmp_path / "hf"), resumed=None).path == "/tok/spm.model"


def test_a_resume_takes_the_tokenizer_its_checkpoint_kept_even_without_the_folder(tmp_path: Path) -> None:
    """A requeued job whose init_from_hf folder was purged resumes: its weights and tokenizer are in
    the checkpoint (every checkpoint holds the run's tokenizer.model)."""
    checkpoint = tmp_path / "checkpoints" / "step_4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "tokenizer.model").write_bytes(b"the run's sentencepiece model")
    gone = str(tmp_path / "purged_hf")
    assert choose_tokenizer(None, gone, resumed=checkpoint).path == str(checkpoint / "tokenizer.model")
    folder = folder_with_tokenizer(tmp_path, b"a replaced sentencepiece model")
    assert choose_tokenizer(None, str(folder), resumed=checkpoint).path == str(checkpoint / "tokenizer.model")


def test_a_resume_whose_data_tokenizer_is_gone_takes_the_checkpoints_copy(tmp_path: Path) -> None:
    """Checkpoints carry the tokenizer they trained with: a resume runs on after the original is deleted."""
    checkpoint = tmp_path / "checkpoints" / "step_4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "tokenizer.json").write_text("{}")
    choice = choose_tokenizer(str(tmp_path / "deleted" / "tokenizer.json"), None, resumed=checkpoint)
    assert choice.path == str(checkpoint / "tokenizer.json") and "is gone" in choice.note
    given = tmp_path / "tokenizer.json"
    given.write_text("{}")
    assert choose_tokenizer(str(given), None, resumed=checkpoint) == (str(given), "data.tokenizer", None, None)
