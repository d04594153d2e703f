"""What build_data makes of the prepared data: the split, the sampler and the lines it logs."""

from functools import partial
from types import SimpleNamespace

import pytest

from parallel.errors import ConfigError
from trainer.config.schema import DataConfig, TrainConfig
from trainer.data import build
from trainer.data.shards import PackedTokens


def _build_data(monkeypatch, tmp_path, num_tokens: int, held_out_fraction: float = 0.0, **overrides) -> list[str]:
    """build_data on `num_tokens` prepared tokens, seq_len 10, one data-parallel rank of batch 8;
    returns its log lines."""
    tokens, tokenizer = SimpleNamespace(num_tokens=num_tokens), SimpleNamespace(bos_id=1)
    tokens.num_sequences = partial(PackedTokens.num_sequences, tokens)  # of the token count alone
    tokens.fingerprint = dict
    monkeypatch.setattr(build, "prepare_dataset", lambda *args, **kwargs: (tokenizer, tokens))
    cfg = TrainConfig(dump_dir=str(tmp_path / "dump"), seq_len=10, batch_size=8,
                      data=DataConfig(held_out_fraction=held_out_fraction), **overrides)
    lines: list[str] = []
    build.build_data(cfg, dp_rank=0, dp_size=1, rank=0, log=lines.append, resumed=None)
    return lines


def test_training_past_one_epoch_is_said_at_startup(monkeypatch, tmp_path) -> None:
    # 1001 tokens: 100 windows of 10 tokens, in 12 global batches of 8 and 4 left over.
    assert _build_data(monkeypatch, tmp_path, 1001, steps=30) == [
        "data: 100 training sequences, 12 steps per epoch; steps=30 is 2.50 epochs: sequences repeat (each epoch "
        "drops the last 4 sequences of its shuffled order)"]
    assert _build_data(monkeypatch, tmp_path, 961, steps=13) == [
        "data: 96 training sequences, 12 steps per epoch; steps=13 is 1.08 epochs: sequences repeat"]


def test_a_run_within_one_epoch_mentions_no_repetition(monkeypatch, tmp_path) -> None:
    assert _build_data(monkeypatch, tmp_path, 1001, steps=12) == ["data: 100 training sequences, 12 steps per epoch"]


def test_a_held_out_split_that_leaves_too_few_sequences_is_named(monkeypatch, tmp_path) -> None:
    # 101 tokens, half held out: training windows end before token 51, five of them.
    with pytest.raises(ConfigError, match=r"exceeds the 5 sequences data.held_out_fraction=0.5 leaves for training"):
        _build_data(monkeypatch, tmp_path, 101, held_out_fraction=0.5)


def test_data_shorter_than_one_sequence_names_seq_len(monkeypatch, tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"^seq_len=10 needs at least 11 tokens but the data has 10$"):
        _build_data(monkeypatch, tmp_path, 10, held_out_fraction=0.01)
