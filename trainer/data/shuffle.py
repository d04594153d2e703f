"""A random permutation of range(n) that can be read at any position without building it.

Shuffling an epoch by sorting n random keys costs every rank 16n bytes and an O(n log n) sort per
epoch: tens of GB and minutes for a 15T-token corpus cut into 8k-token windows. A keyed Feistel network
is a bijection on [0, 4^h) whatever its round function, and "cycle walking" (applying it again while the
result is >= n) turns it into a bijection on [0, n). So reading a step's batch costs O(batch size),
whatever the size of the corpus, and the order depends only on (seed, epoch).
"""

import numpy as np

# Stored with every checkpoint: a resume refuses a data order this version cannot reproduce. Version 1
# was a stable argsort of PCG64 keys per epoch; version 2 is this network.
SHUFFLE_VERSION = 2
_ROUNDS = 8
# splitmix64's finalizer constants: a fast 64-bit mix with good avalanche, used as the round function.
_MIX_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31))
_MIX_MULTIPLIERS = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def _mix(x: np.ndarray) -> np.ndarray:
    x = (x ^ (x >> _MIX_SHIFTS[0])) * _MIX_MULTIPLIERS[0]
    x = (x ^ (x >> _MIX_SHIFTS[1])) * _MIX_MULTIPLIERS[1]
    return x ^ (x >> _MIX_SHIFTS[2])


class RandomPermutation:
    """The permutation of range(n) keyed by (seed, epoch), and by `source` in a blend, so that two sources of
    one size are shuffled apart; `permutation[positions]` reads it."""

    def __init__(self, n: int, seed: int, epoch: int, source: int | None = None) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        # Each Feistel half holds h bits, so the network permutes [0, 4^h) with 4^h < 4n: cycle walking
        # applies it fewer than 4 times per position on average.
        self._half_bits = np.uint64(max(1, ((n - 1).bit_length() + 1) // 2))
        self._half_mask = np.uint64((1 << int(self._half_bits)) - 1)
        key = [seed, epoch] if source is None else [seed, epoch, source]
        self._round_keys = np.random.SeedSequence(key).generate_state(_ROUNDS, dtype=np.uint64)

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        positions = np.asarray(positions, dtype=np.int64)
        if positions.size and (positions.min() < 0 or positions.max() >= self.n):
            raise IndexError(f"positions must lie in [0, {self.n})")
        values = self._network(positions.astype(np.uint64))
        outside = values >= self.n
        while outside.any():
            values[outside] = self._network(values[outside])
            outside = values >= self.n
        return values.astype(np.int64)

    def _network(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half_bits, x & self._half_mask
        for key in self._round_keys:
            left, right = right, left ^ (_mix(right ^ key) & self._half_mask)
        return (left << self._half_bits) | right
