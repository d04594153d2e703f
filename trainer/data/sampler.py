"""Which sequences each optimizer step trains on: a pure function of (step, seed, sizes).

The global batch of step s is chosen without looking at the parallel layout, and each data-parallel
rank takes a contiguous slice of it. So every layout (any tp/pp/cp/dp) with the same global batch size
trains on the same set of sequences per step, which makes losses comparable across layouts, and
resuming only needs the step number.
"""

import numpy as np

from parallel.errors import ConfigError
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


class HeldOutSampler:
    """Evaluation batches: the held-out windows in their fixed order, `global_batch_size` per batch, each
    data-parallel rank a contiguous slice (as in training), so every layout evaluates the same tokens."""

    def __init__(self, windows: range, global_batch_size: int) -> None:
        self.windows, self.global_batch_size = windows, global_batch_size
        self.num_batches = len(windows) // global_batch_size

    def rank_indices(self, batch: int, dp_rank: int, dp_size: int) -> np.ndarray:
        if not 0 <= batch < self.num_batches:
            raise IndexError(f"eval batch {batch} is outside the {self.num_batches} the held-out split holds")
        per_rank = per_rank_batch_size(self.global_batch_size, dp_size)
        start = batch * self.global_batch_size + dp_rank * per_rank
        return np.arange(self.windows.start + start, self.windows.start + start + per_rank, dtype=np.int64)


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
