"""A tokenizer file that is gone when it is read says it is missing and whose it is: data.tokenizer's, the
checkpoint.init_from_hf folder's, a resumed checkpoint's copy, or the one trained into data.cache_dir
(never data.tokenizer=... where the user left data.tokenizer null)."""

import shutil
from pathlib import Path

import pytest

from parallel.errors import ConfigError
from trainer.config.schema import CheckpointConfig, DataConfig, TrainConfig
from trainer.data import build, tokenizer as tokenizers
from trainer.data import prepare as data
from trainer.data.prepare import prepare_dataset
from trainer.data.tokenizer import choose_tokenizer, load_tokenizer
from trainer.data.tokenizer_spm import train_tokenizer

VOCAB = 320


@pytest.fixture(scope="module")
def spm_model(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return train_tokenizer([corpus / "a.txt"], VOCAB, tmp_path_factory.mktemp("tok") / "spm.model").read_bytes()


def test_the_trained_tokenizer_deleted_while_the_data_is_prepared(corpus, tmp_path, monkeypatch) -> None:
    trained: list[Path] = []

    def train_then_lose(files, vocab_size, out, fmt):  # another job clearing data.cache_dir meanwhile
        trained.append(train_tokenizer(files, vocab_size, out, fmt))
        out.unlink()
        return trained[-1]

    monkeypatch.setattr(data, "train_tokenizer", train_then_lose)
    with pytest.raises(ConfigError) as err:
        prepare_dataset(str(corpus), None, VOCAB, tmp_path, True, lambda line: None)
    assert str(err.value) == (
        f"the tokenizer {trained[0]} is missing: it is the one trained on data.source into data.cache_dir "
        "(data.tokenizer is null), and was deleted while the data was prepared; run again to train it anew")
    monkeypatch.undo()  # the advice works: the next run trains it again
    tokenizer, _ = prepare_dataset(str(corpus), None, VOCAB, tmp_path, True, lambda line: None)
    assert tokenizer.path == trained[0] and tokenizer.vocab_size == VOCAB


def test_the_folders_tokenizer_deleted_after_build_data_chose_it(corpus, spm_model, tmp_path, monkeypatch) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(spm_model)

    def choose_then_lose(*args):
        choice = choose_tokenizer(*args)
        Path(choice.path).unlink()
        return choice

    monkeypatch.setattr(build, "choose_tokenizer", choose_then_lose)
    cfg = TrainConfig(data=DataConfig(source=str(corpus), cache_dir=str(tmp_path / "cache")),
                      checkpoint=CheckpointConfig(init_from_hf=str(folder)))
    with pytest.raises(ConfigError) as err:
        build.build_data(cfg, dp_rank=0, dp_size=1, rank=0, log=lambda line: None, resumed=None)
    assert str(err.value) == (
        f"the tokenizer {folder / 'tokenizer.model'} is missing: it is checkpoint.init_from_hf={folder}'s tokenizer "
        "(data.tokenizer is null), and was deleted after the run chose it")


def test_a_checkpoints_copy_deleted_after_it_was_chosen(spm_model, tmp_path) -> None:
    checkpoint = tmp_path / "checkpoints" / "step_4"
    checkpoint.mkdir(parents=True)
    (checkpoint / "tokenizer.model").write_bytes(spm_model)
    gone = tmp_path / "deleted.model"
    choice = choose_tokenizer(str(gone), None, resumed=checkpoint)
    shutil.rmtree(checkpoint)
    with pytest.raises(ConfigError) as err:
        load_tokenizer(choice.path, choice.key, choice.origin)
    assert str(err.value) == (
        f"the tokenizer {checkpoint / 'tokenizer.model'} is missing: it is the resumed checkpoint's copy of "
        f"data.tokenizer={gone} (which is gone), and was deleted after the run chose it")


def test_a_file_deleted_between_finding_and_reading_it(spm_model, tmp_path, monkeypatch) -> None:
    """The narrowest race: the file is found (in a folder), then gone before its bytes are read."""
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "tokenizer.model").write_bytes(spm_model)
    choice = choose_tokenizer(None, str(folder), resumed=None)
    found = tokenizers.tokenizer_file

    def find_then_lose(path: Path) -> Path | None:
        file = found(path)
        file.unlink()
        return file

    monkeypatch.setattr(tokenizers, "tokenizer_file", find_then_lose)
    with pytest.raises(ConfigError) as err:
        load_tokenizer(choice.path, choice.key, choice.origin)
    assert str(err.value) == (
        f"the tokenizer {folder / 'tokenizer.model'} is missing: it is checkpoint.init_from_hf={folder}'s tokenizer "
        "(data.tokenizer is null), and was deleted after the run chose it")
    (folder / "tokenizer.model").write_bytes(spm_model)
    with pytest.raises(ConfigError, match=rf"^data.tokenizer={folder}/tokenizer.model does not exist$"):
        load_tokenizer(folder)  # a folder the user named: the key they set
