"""What build_data makes of the prepared data: the split, the sampler and the lines it logs."""

from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest

from parallel.errors import ConfigError
from trainer.config.schema import DataConfig, EvalConfig, TrainConfig
from trainer.data import build
from trainer.data.shards import PackedTokens


def _build_data(monkeypatch, tmp_path, num_tokens: int, held_out_fraction: float = 0.0, **overrides) -> list[str]:
    """build_data on `num_tokens` prepared tokens, seq_len 10, one data-parallel rank of batch 8;
    returns its log lines."""
    tokens, tokenizer = SimpleNamespace(num_tokens=num_tokens), SimpleNamespace(bos_id=1, eos_id=2)
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


def _build_blend(monkeypatch, tmp_path, sizes: dict[str, int], eval: EvalConfig = EvalConfig(),
                 **data) -> tuple[build.Data, list[str], list]:
    """build_data on sources of `sizes` tokens each (seq_len 10, batch 8); returns the data, its log lines
    and the (source, tokenizer path) each preparation was given, after the sources' files were checked
    disjoint (a call recorded as ("disjoint", sources))."""
    calls = []

    def prepare(source, tokenizer_path, *args, **kwargs):
        calls.append((source, tokenizer_path))
        tokens = SimpleNamespace(num_tokens=sizes[source], fingerprint=lambda: {"data_sha256": source})
        tokens.num_sequences = partial(PackedTokens.num_sequences, tokens)
        return SimpleNamespace(bos_id=1, eos_id=2, path=tmp_path / f"trained-on-{source}"), tokens

    monkeypatch.setattr(build, "prepare_dataset", prepare)
    monkeypatch.setattr(build, "check_disjoint", lambda sources: calls.append(("disjoint", sources)))
    cfg = TrainConfig(dump_dir=str(tmp_path / "dump"), seq_len=10, batch_size=8, steps=25, eval=eval,
                      data=DataConfig(source=list(sizes), **{"held_out_fraction": 0.0, **data}))
    lines: list[str] = []
    return build.build_data(cfg, dp_rank=0, dp_size=1, rank=0, log=lines.append, resumed=None), lines, calls


def test_a_blend_prepares_each_source_with_the_tokenizer_trained_on_the_first(monkeypatch, tmp_path) -> None:
    data, lines, calls = _build_blend(monkeypatch, tmp_path, {"a": 1001, "b": 3001}, weights=[0.8, 0.2])
    assert calls == [("disjoint", ["a", "b"]), ("a", None), ("b", str(tmp_path / "trained-on-a"))]
    assert lines == ["data: every source of the blend is tokenized with the tokenizer trained on data.source[0]=a",
                     "data: blend of 2 sources over steps=25: a (weight 0.8, 100 training sequences, 1.60 epochs: "
                     "sequences repeat); b (weight 0.2, 300 training sequences, 0.13 epochs)"]
    assert data.fingerprint["data.weights"] == [0.8, 0.2]
    # Sequence i < 100 is a's window i, the rest b's: the first batch holds 6 or 7 of a's.
    assert 6 <= int((data.loader.sampler.global_indices(0) < 100).sum()) <= 7


def test_default_weights_follow_each_sources_tokens(monkeypatch, tmp_path) -> None:
    data, _, _ = _build_blend(monkeypatch, tmp_path, {"a": 1000, "b": 3000})
    assert data.fingerprint["data.weights"] == [0.25, 0.75]
    other, _, _ = _build_blend(monkeypatch, tmp_path, {"a": 1000, "b": 3000}, weights=[1.0, 1.0])
    assert other.fingerprint["data.weights"] == [0.5, 0.5]
    assert {k: v for k, v in other.fingerprint.items() if k != "data.weights"} == \
        {k: v for k, v in data.fingerprint.items() if k != "data.weights"}


def test_a_blend_evaluates_on_every_sources_held_out_end(monkeypatch, tmp_path) -> None:
    data, _, _ = _build_blend(monkeypatch, tmp_path, {"a": 2001, "b": 2001}, weights=[0.5, 0.5],
                              held_out_fraction=0.1, eval=EvalConfig(freq=1, steps=2))
    held = np.concatenate([data.eval_loader.sampler.rank_indices(b, 0, 1) for b in range(2)])
    # Each source: 200 windows, from 181 held out (181-199 of a, 381-399 of b), each taken in order.
    assert held.tolist() == [181, 381, 182, 382, 183, 383, 184, 384, 185, 385, 186, 386, 187, 387, 188, 388]
    with pytest.raises(ConfigError, match=r"holds 19, 19 of the sources \(blended by their weights, 32 before one "
                                          r"runs out\); lower eval.steps"):
        _build_blend(monkeypatch, tmp_path, {"a": 2001, "b": 2001}, weights=[0.5, 0.5], held_out_fraction=0.1,
                     eval=EvalConfig(freq=1, steps=5))
