"""The layout-independent sampler: global batches the same for every dp size, epochs reshuffled by seed,
resume state checked, and the held-out split disjoint from training."""

import json

import numpy as np
import pytest

from parallel.errors import ConfigError
from trainer.data.sampler import GlobalBatchSampler, HeldOutSampler, split_windows


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_global_batch_is_layout_independent(dp_size: int) -> None:
    sampler = GlobalBatchSampler(num_sequences=103, global_batch_size=8, seed=7)
    for step in range(30):
        slices = [sampler.rank_indices(step, rank, dp_size) for rank in range(dp_size)]
        assert np.concatenate(slices).tolist() == sampler.global_indices(step).tolist()


def test_sampler_epochs_reshuffle_deterministically() -> None:
    sampler = GlobalBatchSampler(num_sequences=50, global_batch_size=8, seed=3)
    assert sampler.steps_per_epoch == 6  # 2 tail sequences dropped per epoch
    epoch0 = np.concatenate([sampler.global_indices(s) for s in range(6)])
    epoch1 = np.concatenate([sampler.global_indices(s) for s in range(6, 12)])
    assert len(set(epoch0.tolist())) == 48 and len(set(epoch1.tolist())) == 48  # no repeats in an epoch
    assert epoch0.tolist() != epoch1.tolist()
    assert sampler.global_indices(0).tolist() != sampler.global_indices(1).tolist()
    fresh = GlobalBatchSampler(num_sequences=50, global_batch_size=8, seed=3)
    assert fresh.global_indices(7).tolist() == sampler.global_indices(7).tolist()
    other_seed = GlobalBatchSampler(num_sequences=50, global_batch_size=8, seed=4)
    assert other_seed.global_indices(0).tolist() != sampler.global_indices(0).tolist()


def test_a_sampler_accepts_its_own_state_after_a_json_round_trip() -> None:
    """The order is a function of (seed, step) alone (test above), so a resume needs no position from
    the state: it only checks that nothing that shapes the order changed (refusals below)."""
    sampler = GlobalBatchSampler(num_sequences=40, global_batch_size=4, seed=1)
    GlobalBatchSampler(num_sequences=40, global_batch_size=4, seed=1).check_resumable(
        json.loads(json.dumps(sampler.state_dict())))


@pytest.mark.parametrize(
    ("field", "match"),
    [("seed", "seed"), ("num_sequences", "data.source, seq_len or data.held_out_fraction"), ("global_batch_size", "batch_size"),
     ("shuffle_version", "shuffled the data another way"), ("split_version", "split off the held-out data another way")],
)
def test_sampler_refuses_changed_state(field: str, match: str) -> None:
    state = GlobalBatchSampler(num_sequences=40, global_batch_size=4, seed=1).state_dict()
    state[field] += 2
    with pytest.raises(ConfigError, match=match):
        GlobalBatchSampler(num_sequences=40, global_batch_size=4, seed=1).check_resumable(state)


def test_sampler_errors_name_batch_size() -> None:
    with pytest.raises(ConfigError, match=r"^batch_size: .* exceeds the 4 sequences in the data \(lower batch_size or "
                                          r"seq_len, or add data\)$"):
        GlobalBatchSampler(num_sequences=4, global_batch_size=8, seed=0)
    with pytest.raises(ConfigError, match="batch_size"):
        GlobalBatchSampler(num_sequences=40, global_batch_size=6, seed=0).rank_indices(0, 0, 4)


def test_too_few_training_sequences_names_the_held_out_fraction_that_took_them() -> None:
    with pytest.raises(ConfigError, match=r"^batch_size: global batch of 8 sequences exceeds the 6 sequences "
                                          r"data.held_out_fraction=0.2 leaves for training \(lower batch_size, seq_len "
                                          r"or data.held_out_fraction, or add data\)$"):
        GlobalBatchSampler(num_sequences=6, global_batch_size=8, seed=0, held_out_fraction=0.2)


@pytest.mark.parametrize("num_tokens, seq_len, fraction", [(16001, 16, 0.01), (913, 16, 0.1), (641, 16, 0.0)])
def test_held_out_split_is_disjoint_from_training_and_layout_independent(num_tokens, seq_len, fraction):
    train, held_out = split_windows(num_tokens, seq_len, fraction)
    # Window i reads tokens [i*L, i*L + L]: no held-out token is a training input or target.
    train_tokens = set(range(0, train * seq_len + 1))
    held_out_tokens = {t for w in held_out for t in range(w * seq_len, w * seq_len + seq_len + 1)}
    assert not train_tokens & held_out_tokens
    assert max(held_out_tokens, default=0) < num_tokens
    sampler = GlobalBatchSampler(train, global_batch_size=4, seed=0)
    assert max(max(sampler.global_indices(s)) for s in range(3 * sampler.steps_per_epoch)) < train
    if not held_out:
        return
    evals = HeldOutSampler(held_out, global_batch_size=2)
    for batch in range(evals.num_batches):
        whole = evals.rank_indices(batch, 0, 1)
        assert np.array_equal(np.concatenate([evals.rank_indices(batch, r, 2) for r in range(2)]), whole)
        assert all(w in held_out for w in whole)
    with pytest.raises(IndexError, match="outside"):
        evals.rank_indices(evals.num_batches, 0, 1)


@pytest.mark.parametrize("fraction", [0.01, 0.05, 0.1])
def test_no_run_evaluates_on_a_token_another_seq_len_trained_on(fraction: float) -> None:
    """Run B (say a longer context started from run A's weights) on the same corpus and fraction: the
    last token any of A's training windows reads comes before the first of any of B's held-out windows."""
    rng = np.random.default_rng(0)
    for _ in range(2000):
        num_tokens = int(rng.integers(2_000_000, 50_000_000))  # 1% of it holds two 8192-token windows
        seq_len_a, seq_len_b = (int(n) for n in rng.integers(128, 8193, size=2))
        train_a, _ = split_windows(num_tokens, seq_len_a, fraction)
        _, held_out_b = split_windows(num_tokens, seq_len_b, fraction)
        assert train_a * seq_len_a < held_out_b.start * seq_len_b, (num_tokens, seq_len_a, seq_len_b)
        # B's held-out windows lie inside the corpus and hold its fraction of tokens, less two windows at most.
        assert held_out_b.stop * seq_len_b < num_tokens
        held_out_tokens = len(held_out_b) * seq_len_b
        assert (num_tokens - 1) * fraction - 2 * seq_len_b < held_out_tokens < (num_tokens - 1) * fraction


def test_without_a_held_out_fraction_every_window_trains() -> None:
    for num_tokens, seq_len in [(129, 128), (1000, 7), (12345, 128)]:
        train, held_out = split_windows(num_tokens, seq_len, 0.0)
        assert train == (num_tokens - 1) // seq_len and len(held_out) == 0
