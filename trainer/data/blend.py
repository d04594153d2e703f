"""A blend of sources: which source each sample of the run comes from, and the sources' sequences as one
index space.

The order is the greedy one of Megatron's BlendedDataset: sample i goes to the source whose count lags its
weight most, counting the sample drawn (the largest (i + 1) * w_j - count_j, the first such source on a
tie; Megatron counts max(i, 1)). Every lag
then stays above -1 (the chosen lag is at least 1/k before the draw) and the lags sum to 0, so each
source's count stays within a sample or two of its share: every window of samples holds each source's
share to within a few samples, not just on average over the run. The weights are made integer quotas q_j
(to 1 part in BLEND_RESOLUTION of their sum, a positive weight never below one part, reduced by their
greatest common divisor) whose sum P is the period: after P samples every count is its quota exactly (an
integer lag above -1 that sums to 0 with the others is 0), so the order repeats every P samples. One
period's table, built once, reads any sample of any step in O(1): a resume or a late step costs no
replay of the steps before it.
"""

import hashlib
import json
import math
from collections.abc import Sequence

import numpy as np

from parallel.errors import ConfigError
from trainer.data.shards import PackedTokens

BLEND_RESOLUTION = 100_000


def blend_quotas(weights: Sequence[float]) -> list[int]:
    """Integer quotas in the proportions of `weights` (non-negative, not all 0), as small as they go."""
    total = sum(weights)
    quotas = [max(1, round(BLEND_RESOLUTION * weight / total)) if weight > 0 else 0 for weight in weights]
    divisor = math.gcd(*quotas)
    return [quota // divisor for quota in quotas]


class BlendOrder:
    """The source of every sample, and its ordinal among that source's samples, from one period's table."""

    def __init__(self, quotas: Sequence[int]) -> None:
        self.quotas = np.array(quotas, dtype=np.int64)
        self.period = int(self.quotas.sum())
        sources, ordinals = _one_period([int(q) for q in quotas])
        self._source, self._ordinal = np.array(sources, dtype=np.int64), np.array(ordinals, dtype=np.int64)

    @property
    def weights(self) -> list[float]:
        """The share of each source, as the order realizes it."""
        return [int(quota) / self.period for quota in self.quotas]

    def draw(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, ordinal) of each sample at `positions`: the ordinal-th sample its source gives."""
        cycles, offsets = np.divmod(np.asarray(positions, dtype=np.int64), self.period)
        sources = self._source[offsets]
        return sources, cycles * self.quotas[sources] + self._ordinal[offsets]

    def drawn(self, count: int) -> np.ndarray:
        """How many of the first `count` samples each source gives."""
        cycles, rest = divmod(count, self.period)
        return cycles * self.quotas + np.bincount(self._source[:rest], minlength=len(self.quotas))


def _one_period(quotas: list[int]) -> tuple[list[int], list[int]]:
    """The greedy order over one period, in integers (lags scaled by the period): exact on every machine."""
    period, counts = sum(quotas), [0] * len(quotas)
    sources, ordinals = [], []
    for i in range(1, period + 1):
        lags = [i * quota - count * period for quota, count in zip(quotas, counts)]
        chosen = lags.index(max(lags))
        sources.append(chosen)
        ordinals.append(counts[chosen])
        counts[chosen] += 1
    return sources, ordinals


class BlendedTokens:
    """The sequences of several sources' packed tokens as one index space: source j's window w is sequence
    offsets[j] + w. A sequence never runs from one source into the next."""

    def __init__(self, names: list[str], parts: list[PackedTokens], seq_len: int) -> None:
        counts = []
        for name, part in zip(names, parts):
            try:
                counts.append(part.num_sequences(seq_len))
            except ConfigError as e:
                raise ConfigError(f"data.source {name}: {e}" if len(parts) > 1 else str(e)) from e
        self.names, self.parts = names, parts
        self.offsets = np.cumsum([0, *counts], dtype=np.int64)

    def source_of(self, index: int) -> int:
        return int(np.searchsorted(self.offsets, index, side="right")) - 1

    def sequence(self, index: int, seq_len: int) -> np.ndarray:
        """Sequence `index` of the blend: tokens [w*seq_len, w*seq_len + seq_len + 1) of its source's window w."""
        source = self.source_of(index)
        return self.parts[source].sequence(index - int(self.offsets[source]), seq_len)


def blend_fingerprint(parts: list[dict[str, str]], weights: list[float]) -> dict:
    """What a checkpoint records of the blend: the hashes of one source as they are (so a checkpoint of a
    single source written before blends resumes), of several the hash of theirs in order; and the weights
    the order realizes, so that changing a weight is a change of the data."""
    if len(parts) == 1:
        return parts[0] | {"data.weights": weights}
    joined = {key: hashlib.sha256(json.dumps([part[key] for part in parts]).encode()).hexdigest()[:16]
              for key in parts[0]}
    return joined | {"data.weights": weights}
