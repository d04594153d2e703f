"""TP-aware random streams (Megatron's "model-parallel RNG tracker").

Outside tensor-parallel regions every TP rank must draw the same numbers (dropout on a replicated
activation must drop the same elements everywhere); inside a TP region each rank holds different
features, so its draws must differ, yet be reproducible. `tp_region()` swaps the default generator
for a TP-rank-specific stream and swaps it back afterwards, so the shared stream continues exactly
as if the region had drawn nothing.

The Llama model draws nothing (no dropout). A module that draws inside `tp_region` under activation
checkpointing needs more: torch's checkpoint replays only the default generator, so its recompute
would draw from the TP stream where it stands by then, not where the forward drew (Megatron's
checkpoint saves and restores its tracker's states for this).
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_TP_SEED_OFFSET = 2718


class RNGStreams:
    def __init__(self, seed: int, tp_rank: int, device: torch.device):
        self.device = device
        self._tp_state = self._fresh_state(seed + _TP_SEED_OFFSET + tp_rank)

    def _fresh_state(self, seed: int) -> torch.Tensor:
        # A generator of its own on this rank's device: seeding the current CUDA device instead would touch
        # another device's stream where the two differ.
        return torch.Generator(self.device).manual_seed(seed).get_state()

    def _get(self) -> torch.Tensor:
        return torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextmanager
    def tp_region(self) -> Iterator[None]:
        shared = self._get()
        self._set(self._tp_state)
        try:
            yield
        finally:
            self._tp_state = self._get()
            self._set(shared)

    def state(self) -> dict[str, torch.Tensor]:
        """For checkpoints: the shared stream and this rank's TP stream."""
        return {"shared": self._get(), "tp": self._tp_state.clone()}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self._set(state["shared"])
        self._tp_state = state["tp"].clone()
