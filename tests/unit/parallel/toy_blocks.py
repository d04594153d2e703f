"""The toy model the one-process FSDP unit tests shard: two blocks of two small linears each."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def two_blocks() -> nn.Sequential:
    """Seeded, so every call builds the same weights (the reference and the model to shard)."""
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())
