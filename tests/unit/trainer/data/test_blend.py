"""The blend of sources: the order against a plain re-statement of Megatron's greedy rule, each source's
share in every window of global batches, the same batches for every data-parallel layout, each source's
own epochs, the held-out batches, and the blend's sequences and fingerprint."""

import random
from fractions import Fraction

import numpy as np
import pytest

from parallel.errors import ConfigError
from trainer.data.blend import BlendedTokens, BlendOrder, blend_fingerprint, blend_quotas
from trainer.data.sampler import BlendedBatchSampler, HeldOutSampler


def greedy_sources(weights: list[Fraction], count: int) -> list[int]:
    """Sample i from the source that lags its weight most once the sample is drawn, the first on a tie, in
    exact fractions: the rule as Megatron's build_blending_indices states it (counting the sample drawn)."""
    counts, order = [0] * len(weights), []
    for i in range(count):
        lags = [(i + 1) * weight - c for weight, c in zip(weights, counts)]
        chosen = lags.index(max(lags))
        counts[chosen] += 1
        order.append(chosen)
    return order


def sampler_of(weights: list[float], train_windows: list[int], global_batch: int, seed: int = 5) -> BlendedBatchSampler:
    offsets = np.cumsum([0, *train_windows])
    return BlendedBatchSampler(train_windows, offsets, BlendOrder(blend_quotas(weights)), global_batch, seed,
                               [f"s{i}" for i in range(len(weights))])


def source_counts(sampler: BlendedBatchSampler, step: int) -> np.ndarray:
    sources = np.searchsorted(sampler.offsets, sampler.global_indices(step), side="right") - 1
    return np.bincount(sources, minlength=len(sampler.train_windows))


def test_quotas_are_the_weights_in_smallest_integers() -> None:
    assert blend_quotas([0.8, 0.2]) == [4, 1]
    assert blend_quotas([3, 1, 0]) == [3, 1, 0]
    assert blend_quotas([1e-9, 1.0]) == [1, 100_000]  # a positive weight is never rounded to nothing
    assert BlendOrder(blend_quotas([0.8, 0.2])).weights == [0.8, 0.2]


@pytest.mark.parametrize("quotas", [[4, 1], [1, 1], [3, 0, 2], [7, 5, 3, 1], [1, 12, 30]])
def test_the_order_is_the_greedy_rule_repeating_every_period(quotas: list[int]) -> None:
    order = BlendOrder(quotas)
    period = sum(quotas)
    count = 3 * period + 2
    sources, ordinals = order.draw(np.arange(count))
    expected = greedy_sources([Fraction(q, period) for q in quotas], count)
    assert sources.tolist() == expected
    # The ordinal of a sample is how many samples of its source came before it.
    assert ordinals.tolist() == [expected[:i].count(s) for i, s in enumerate(expected)]
    for n in (0, 1, period, count):
        assert order.drawn(n).tolist() == [expected[:n].count(j) for j in range(len(quotas))]


def test_every_window_of_8_global_batches_holds_80_percent_of_the_first_source() -> None:
    sampler = sampler_of([0.8, 0.2], [500, 300], global_batch=8)
    per_step = np.array([source_counts(sampler, step) for step in range(200)])
    assert per_step.sum(axis=1).tolist() == [8] * 200
    windows = np.lib.stride_tricks.sliding_window_view(per_step[:, 0], 8).sum(axis=1) / 64
    assert len(windows) == 193 and np.all(np.abs(windows - 0.8) <= 0.03), windows.min()


def test_any_weights_hold_in_every_window_to_within_a_few_samples() -> None:
    rng = random.Random(0)
    for _ in range(20):
        weights = [rng.random() for _ in range(rng.randint(2, 6))]
        share = np.array(BlendOrder(blend_quotas(weights)).weights)
        assert np.allclose(share, np.array(weights) / sum(weights), atol=1e-5)
        sampler = sampler_of(weights, [rng.randint(1, 50) for _ in weights], global_batch=rng.randint(1, 16))
        per_step = np.array([source_counts(sampler, step) for step in range(60)])
        for size in (1, 8, 30):
            windows = np.lib.stride_tricks.sliding_window_view(per_step, size, axis=0).sum(axis=2)
            expected = size * sampler.global_batch_size * share
            assert np.abs(windows - expected).max() < len(weights), (weights, size)


@pytest.mark.parametrize("dp_size", [1, 2, 4])
def test_the_global_batch_is_the_same_on_every_layout(dp_size: int) -> None:
    sampler = sampler_of([0.6, 0.3, 0.1], [17, 40, 3], global_batch=8)
    again = sampler_of([0.6, 0.3, 0.1], [17, 40, 3], global_batch=8)
    for step in (0, 1, 7, 55, 10_000):
        whole = sampler.global_indices(step)
        assert np.concatenate([sampler.rank_indices(step, r, dp_size) for r in range(dp_size)]).tolist() == whole.tolist()
        assert again.global_indices(step).tolist() == whole.tolist()  # a pure function: a resume needs no state


def test_each_source_goes_through_its_own_epochs_each_reshuffled() -> None:
    sampler = sampler_of([0.5, 0.5], [4, 1000], global_batch=4)
    drawn = np.concatenate([sampler.global_indices(step) for step in range(8)])  # 16 samples of source 0
    small = drawn[drawn < 4]
    assert len(small) == 16
    epochs = small.reshape(4, 4)
    assert all(sorted(epoch) == [0, 1, 2, 3] for epoch in epochs.tolist())  # each epoch: every sequence once
    assert len({tuple(epoch) for epoch in epochs.tolist()}) > 1  # and in another order
    large = drawn[drawn >= 4]
    assert len(set(large.tolist())) == 16  # the other source is within its first epoch: no repeats
    other_seed = sampler_of([0.5, 0.5], [4, 1000], global_batch=4, seed=6)
    assert other_seed.global_indices(0).tolist() != sampler.global_indices(0).tolist()


def test_the_start_line_gives_each_source_its_weight_and_epochs() -> None:
    sampler = sampler_of([0.8, 0.2], [10, 300], global_batch=8)
    # 25 steps: 200 samples, 40 periods of 5: 160 of the first source, 40 of the second.
    assert sampler.epochs_line(25) == (
        "data: blend of 2 sources over steps=25: s0 (weight 0.8, 10 training sequences, 16.00 epochs: sequences "
        "repeat); s1 (weight 0.2, 300 training sequences, 0.13 epochs)")


def test_a_weighted_source_without_training_sequences_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^data.source s1 leaves no training sequence .*weight 0 in data.weights"):
        sampler_of([0.5, 0.5], [10, 0], global_batch=2)
    sampler_of([1.0, 0.0], [10, 0], global_batch=2)  # weight 0: never drawn


def test_held_out_batches_are_blended_and_stop_before_a_source_runs_out() -> None:
    order = BlendOrder(blend_quotas([0.75, 0.25]))
    held = [range(90, 100), range(200, 203)]  # 10 and 3 held-out sequences
    evals = HeldOutSampler(held, global_batch_size=4, order=order)
    # 3 of every 4 from the first: 3 batches take 9 and 3; a fourth would need 4 of the second.
    assert evals.num_batches == 3 and evals.num_windows == 12
    seen = np.concatenate([evals.rank_indices(b, 0, 1) for b in range(3)])
    assert sorted(seen.tolist()) == [*range(90, 99), *range(200, 203)]  # in order, none twice
    split = [np.concatenate([evals.rank_indices(b, r, 2) for r in range(2)]) for b in range(3)]
    assert np.concatenate(split).tolist() == seen.tolist()
    one = HeldOutSampler(range(5, 16), global_batch_size=4)  # one source: its windows in order
    assert one.num_batches == 2 and one.rank_indices(1, 1, 2).tolist() == [11, 12]


class Windows:
    """Packed tokens of `count` windows whose tokens name their source and window."""

    def __init__(self, source: int, count: int, seq_len: int) -> None:
        self.source, self.count = source, count

    def num_sequences(self, seq_len: int) -> int:
        if self.count < 1:
            raise ConfigError(f"seq_len={seq_len} needs at least {seq_len + 1} tokens but the data has 3")
        return self.count

    def sequence(self, index: int, seq_len: int) -> np.ndarray:
        assert 0 <= index < self.count
        return np.full(seq_len + 1, 1000 * self.source + index)


def test_blended_tokens_read_each_source_at_its_offset() -> None:
    tokens = BlendedTokens(["a", "b", "c"], [Windows(0, 3, 4), Windows(1, 5, 4), Windows(2, 1, 4)], 4)
    assert tokens.offsets.tolist() == [0, 3, 8, 9]
    assert [int(tokens.sequence(i, 4)[0]) for i in range(9)] == [0, 1, 2, 1000, 1001, 1002, 1003, 1004, 2000]
    assert [tokens.source_of(i) for i in (0, 2, 3, 7, 8)] == [0, 0, 1, 1, 2]
    with pytest.raises(ConfigError, match=r"^data.source b: seq_len=4 needs at least 5 tokens"):
        BlendedTokens(["a", "b"], [Windows(0, 3, 4), Windows(1, 0, 4)], 4)


def test_the_fingerprint_changes_with_the_weights_and_the_sources() -> None:
    a = {"data_sha256": "aa", "data": "ab", "data_sample": "ac"}
    b = {"data_sha256": "ba", "data": "bb", "data_sample": "bc"}
    assert blend_fingerprint([a], [1.0]) == a | {"data.weights": [1.0]}  # one source: as before blends
    blend = blend_fingerprint([a, b], [0.8, 0.2])
    assert blend["data.weights"] == [0.8, 0.2]
    assert blend_fingerprint([a, b], [0.5, 0.5]) != blend
    swapped = blend_fingerprint([b, a], [0.8, 0.2])
    assert all(swapped[key] != blend[key] for key in a)
