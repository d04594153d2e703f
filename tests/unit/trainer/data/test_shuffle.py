"""The epoch shuffle: a bijection on range(n), readable at any position, fixed by (seed, epoch)."""

import numpy as np
import pytest

from trainer.data.shuffle import RandomPermutation

_M64 = (1 << 64) - 1


def _reference_value(n: int, seed: int, epoch: int, position: int) -> int:
    """The same keyed Feistel network with cycle walking, one position at a time in Python integers."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = (1 << half) - 1
    keys = [int(k) for k in np.random.SeedSequence([seed, epoch]).generate_state(8, dtype=np.uint64)]

    def mix(x: int) -> int:
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
        return x ^ (x >> 31)

    value = position
    while True:
        left, right = value >> half, value & mask
        for key in keys:
            left, right = right, left ^ (mix(right ^ key) & mask)
        value = (left << half) | right
        if value < n:
            return value


@pytest.mark.parametrize("n", [*range(1, 70), 255, 256, 257, 1000, 4097])
def test_every_size_gets_a_bijection(n: int) -> None:
    values = RandomPermutation(n, seed=3, epoch=1)[np.arange(n)]
    assert sorted(values.tolist()) == list(range(n))


def test_matches_a_scalar_reference_and_reads_any_positions() -> None:
    for n, seed, epoch in [(50, 0, 0), (1025, 7, 3), (1_800_000_000, 5, 2)]:
        positions = np.array(sorted({0, 1, n // 3, n // 2, n - 1}))
        got = RandomPermutation(n, seed, epoch)[positions[::-1]][::-1]  # read out of order
        assert got.tolist() == [_reference_value(n, seed, epoch, int(p)) for p in positions]


def test_order_is_well_mixed_and_changes_with_seed_and_epoch() -> None:
    n = 20_000
    positions = np.arange(n)
    values = RandomPermutation(n, seed=0, epoch=0)[positions]
    assert abs(np.corrcoef(values, positions)[0, 1]) < 0.03
    assert (values == positions).sum() < 10  # a random permutation has ~1 fixed point
    first_tenth = np.histogram(values[: n // 10], bins=10, range=(0, n))[0]
    assert first_tenth.min() > 140 and first_tenth.max() < 260  # ~200 expected in each bucket
    for other in (RandomPermutation(n, seed=1, epoch=0), RandomPermutation(n, seed=0, epoch=1)):
        assert (other[positions] == values).mean() < 0.01


def test_positions_outside_the_range_are_refused() -> None:
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        RandomPermutation(10, seed=0, epoch=0)[np.array([3, 10])]
    with pytest.raises(ValueError, match="n >= 1"):
        RandomPermutation(0, seed=0, epoch=0)
