"""What a checkpoint holds, as one DCP state dict: fp32 weights, optimizer state, step, RNG.

Everything is a tensor (no pickled objects), so loading never unpickles user data. The sampler needs
no state of its own: the global batch of step s is a pure function of (seed, s).
"""

from pathlib import Path

import torch

from trainer.checkpoint import checkpoint_keys
from trainer.optimizer import MasterAdamW


def rng_key(rank: int) -> str:
    return f"rank{rank}"


def checkpoint_state(optimizer: MasterAdamW, step: int, rank: int) -> dict:
    return {
        "model": {n: p.detach() for n, p in optimizer.weights().items()},
        "optim": optimizer.state_dict(),
        "trainer": {"step": torch.tensor(step, dtype=torch.int64)},
        "rng": {rng_key(rank): torch.get_rng_state()},
    }


def load_template(optimizer: MasterAdamW, rank: int, path: Path) -> dict:
    """Tensors to load into; this rank's RNG only if the checkpoint has it (same world layout)."""
    state = {
        "model": {n: torch.empty_like(p) for n, p in optimizer.weights().items()},
        "optim": optimizer.state_template(),
        "trainer": {"step": torch.zeros((), dtype=torch.int64)},
    }
    if f"rng.{rng_key(rank)}" in checkpoint_keys(path):
        state["rng"] = {rng_key(rank): torch.empty_like(torch.get_rng_state())}
    return state


def apply_loaded(optimizer: MasterAdamW, state: dict, rank: int) -> int:
    """Put loaded tensors in place; returns the step the checkpoint was taken after."""
    optimizer.load_state(state["model"], state["optim"])
    if "rng" in state:
        torch.set_rng_state(state["rng"][rng_key(rank)])
    return int(state["trainer"]["step"])
