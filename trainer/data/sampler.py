"""Which sequences each optimizer step trains on: a pure function of (step, seed, sizes).

The global batch of step s is chosen without looking at the parallel layout, and each data-parallel
rank takes a contiguous slice of it. So every layout (any tp/pp/cp/dp) with the same global batch size
trains on the same set of sequences per step, which makes losses comparable across layouts, and
resuming only needs the step number.
"""

import numpy as np

from parallel.errors import ConfigError
from trainer.data.blend import BlendOrder
from trainer.data.shuffle import SHUFFLE_VERSION, RandomPermutation

# Stored with every checkpoint, as the shuffle's version is: a resume refuses a split this version does not
# make. Version 1 held out the last fraction of seq_len windows; version 2 the last fraction of tokens.
SPLIT_VERSION = 2


class GlobalBatchSampler:
    """Epoch-wise reshuffled global batches of sequence indices; drops each epoch's ragged tail."""

    def __init__(self, num_sequences: int, global_batch_size: int, seed: int, held_out_fraction: float = 0.0) -> None:
        """`held_out_fraction`: what data.held_out_fraction took from the data, named when too little is left."""
        if global_batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1 (global batch size is {global_batch_size})")
        if global_batch_size > num_sequences:
            raise ConfigError(f"batch_size: global batch of {global_batch_size} sequences exceeds the "
                              + _too_few_sequences(num_sequences, held_out_fraction))
        if seed < 0:
            raise ConfigError(f"seed={seed} must be >= 0")
        self.num_sequences = num_sequences
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle_version = SHUFFLE_VERSION
        self.split_version = SPLIT_VERSION
        self.steps_per_epoch = num_sequences // global_batch_size

    def epochs_line(self, steps: int) -> str:
        """The startup line saying how `steps` covers the data: training past one epoch repeats sequences,
        which no loss curve shows until the model memorizes them."""
        line = f"data: {self.num_sequences} training sequences, {self.steps_per_epoch} steps per epoch"
        if steps <= self.steps_per_epoch:
            return line
        line += f"; steps={steps} is {steps / self.steps_per_epoch:.2f} epochs: sequences repeat"
        dropped = self.num_sequences % self.global_batch_size
        return line + (f" (each epoch drops the last {dropped} sequences of its shuffled order)" if dropped else "")

    def global_indices(self, step: int) -> np.ndarray:
        """Sequence indices of optimizer step `step` (0-based), in global-batch order."""
        return self._read(step, 0, self.global_batch_size)

    def rank_indices(self, step: int, dp_rank: int, dp_size: int) -> np.ndarray:
        """The contiguous slice of step `step`'s global batch that data-parallel rank `dp_rank` trains on."""
        per_rank = per_rank_batch_size(self.global_batch_size, dp_size)
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
        return self._read(step, dp_rank * per_rank, per_rank)

    def _read(self, step: int, offset: int, count: int) -> np.ndarray:
        """`count` indices from `offset` in step `step`'s global batch: the permutation is read at
        just those positions, so a rank never computes the others' share."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        epoch, position = divmod(step, self.steps_per_epoch)
        start = position * self.global_batch_size + offset
        positions = np.arange(start, start + count, dtype=np.int64)
        return RandomPermutation(self.num_sequences, self.seed, epoch)[positions]

    def state_dict(self) -> dict[str, int]:
        """What fixes the data order. The position needs no state: step s's batch is a pure function
        of these and s, so a checkpoint's step number is enough to resume."""
        return {key: getattr(self, key) for key in _RESUME_HINTS}

    def check_resumable(self, state: dict[str, int]) -> None:
        """Refuse a checkpoint written with a different seed, data, global batch size, shuffle or split."""
        for key, hint in _RESUME_HINTS.items():
            if int(state[key]) != getattr(self, key):
                raise ConfigError(
                    f"{hint}: the checkpoint was written with {key}={state[key]}, "
                    f"now {key}={getattr(self, key)}; resuming would change the data order"
                )


class BlendedBatchSampler(GlobalBatchSampler):
    """Global batches of a blend of sources. Sample n of the run (step s holds samples s*G .. s*G + G - 1)
    is the next sequence of the source the blend's order names; each source walks through its own training
    sequences in an order reshuffled every epoch of its own, so a source used up before the run ends
    starts its next epoch while the others go on."""

    def __init__(self, train_windows: list[int], offsets: np.ndarray, order: BlendOrder, global_batch_size: int,
                 seed: int, names: list[str]) -> None:
        """`train_windows`: each source's training sequences, source j's first at index `offsets[j]`."""
        if global_batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1 (global batch size is {global_batch_size})")
        if seed < 0:
            raise ConfigError(f"seed={seed} must be >= 0")
        for name, count, quota in zip(names, train_windows, order.quotas):
            if quota and count < 1:
                raise ConfigError(f"data.source {name} leaves no training sequence (lower seq_len or "
                                  "data.held_out_fraction, or give it weight 0 in data.weights)")
        self.train_windows, self.offsets, self.order, self.names = train_windows, offsets, order, names
        self.num_sequences = sum(train_windows)
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle_version = SHUFFLE_VERSION
        self.split_version = SPLIT_VERSION

    def epochs_line(self, steps: int) -> str:
        """Each source's weight, training sequences and epochs over `steps`: a source past one epoch repeats."""
        drawn = self.order.drawn(steps * self.global_batch_size)
        parts = []
        for name, weight, count, taken in zip(self.names, self.order.weights, self.train_windows, drawn):
            epochs = taken / count if count else 0.0
            parts.append(f"{name} (weight {weight:.4g}, {count} training sequences, {epochs:.2f} epochs"
                         + (": sequences repeat)" if epochs > 1 else ")"))
        return f"data: blend of {len(parts)} sources over steps={steps}: " + "; ".join(parts)

    def _read(self, step: int, offset: int, count: int) -> np.ndarray:
        if step < 0:
            raise ValueError(f"step={step} must be >= 0")
        start = step * self.global_batch_size + offset
        sources, ordinals = self.order.draw(np.arange(start, start + count, dtype=np.int64))
        indices = np.empty(count, dtype=np.int64)
        for source in np.unique(sources):
            picked = sources == source
            epochs, positions = np.divmod(ordinals[picked], self.train_windows[source])
            local = np.empty(len(positions), dtype=np.int64)
            for epoch in np.unique(epochs):
                here = epochs == epoch
                local[here] = RandomPermutation(self.train_windows[source], self.seed, int(epoch),
                                                int(source))[positions[here]]
            indices[picked] = self.offsets[source] + local
        return indices


class HeldOutSampler:
    """Evaluation batches: each source's held-out windows in their fixed order, blended as training is
    (one source: its windows in order), `global_batch_size` per batch, each data-parallel rank a
    contiguous slice (as in training), so every layout evaluates the same tokens."""

    def __init__(self, windows: range | list[range], global_batch_size: int, order: BlendOrder | None = None) -> None:
        """`windows`: each source's held-out sequence indices (a range: one source's); `order`: the blend's."""
        self.windows = [windows] if isinstance(windows, range) else windows
        self.global_batch_size = global_batch_size
        self.order = order or BlendOrder([1])
        sizes = np.array([len(w) for w in self.windows])
        # The most batches no source runs out of held-out windows for (drawn counts grow with the count).
        low, high = 0, int(sizes.sum()) // global_batch_size
        while low < high:
            middle = (low + high + 1) // 2
            fits = bool((self.order.drawn(middle * global_batch_size) <= sizes).all())
            low, high = (middle, high) if fits else (low, middle - 1)
        self.num_batches = low
        self.num_windows = int(self.order.drawn(low * global_batch_size).sum())

    def rank_indices(self, batch: int, dp_rank: int, dp_size: int) -> np.ndarray:
        if not 0 <= batch < self.num_batches:
            raise IndexError(f"eval batch {batch} is outside the {self.num_batches} the held-out split holds")
        per_rank = per_rank_batch_size(self.global_batch_size, dp_size)
        start = batch * self.global_batch_size + dp_rank * per_rank
        sources, ordinals = self.order.draw(np.arange(start, start + per_rank, dtype=np.int64))
        starts = np.array([w.start for w in self.windows], dtype=np.int64)
        return starts[sources] + ordinals


def split_windows(num_tokens: int, seq_len: int, held_out_fraction: float) -> tuple[int, range]:
    """Training windows [0, n) and the held-out ones, split at a token: the corpus' last
    int((num_tokens - 1) * held_out_fraction) tokens are held out (num_tokens - 1 tokens are ever a
    target, so a fraction of 0 trains on every window). The boundary does not depend on seq_len, so a
    run with another seq_len on the same corpus (a longer context started from this one's weights)
    never evaluates on a token this one trained on. Window i reads tokens [i*L, i*L + L]: training
    windows end before the boundary, held-out ones start at or after it, the one across it is skipped."""
    boundary = num_tokens - int((num_tokens - 1) * held_out_fraction)
    first_held_out = -(-boundary // seq_len)
    num_windows = (num_tokens - 1) // seq_len
    return (boundary - 1) // seq_len, range(first_held_out, max(first_held_out, num_windows))


# Which user-facing config key changed when a sampler field no longer matches the checkpoint.
_RESUME_HINTS = {
    "seed": "seed changed",
    "num_sequences": "data.source, seq_len or data.held_out_fraction changed",
    "global_batch_size": "batch_size (or the data-parallel size) changed",
    "shuffle_version": "the trainer version that wrote the checkpoint shuffled the data another way (finish the "
                       "run with that version, or start it over in a new dump_dir)",
    "split_version": "the trainer version that wrote the checkpoint split off the held-out data another way (finish "
                     "the run with that version, or start it over in a new dump_dir)",
}


def _too_few_sequences(num_sequences: int, held_out_fraction: float) -> str:
    if held_out_fraction > 0:
        return (f"{num_sequences} sequences data.held_out_fraction={held_out_fraction:g} leaves for training (lower "
                "batch_size, seq_len or data.held_out_fraction, or add data)")
    return f"{num_sequences} sequences in the data (lower batch_size or seq_len, or add data)"


def per_rank_batch_size(global_batch_size: int, dp_size: int) -> int:
    """Sequences per data-parallel rank; the global batch must split evenly."""
    if dp_size < 1 or global_batch_size % dp_size:
        raise ConfigError(
            f"batch_size: global batch of {global_batch_size} sequences is not divisible by "
            f"the data-parallel size {dp_size}"
        )
    return global_batch_size // dp_size
