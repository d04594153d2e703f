"""Autoregressive generation from a whole model in one process: the prompt is prefilled once, then each
new token is one forward step through the KV cache (model/kv_cache.py). Temperature 0 is greedy
(argmax); otherwise tokens are sampled with a temperature and top-p (nucleus) filter."""

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from model.kv_cache import KVCache, forward_cached
from model.transformer import Transformer


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0  # sample among the most likely tokens that together hold this much probability
    seed: int = 0  # of the generator that draws the samples: the same seed draws the same completion

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature} must be 0 (greedy) or a positive number")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if not -(2**63) <= self.seed < 2**64:  # what torch.Generator.manual_seed takes
            raise ValueError(f"seed={self.seed} must be from -2**63 to 2**64 - 1")


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """`probs` [vocab] with all but the nucleus zeroed: the most likely tokens, in order, until their
    mass reaches top_p (the token that reaches it included, so the most likely one always stays).
    top_p=1 keeps every token: an fp32 cumsum can reach 1.0 before the tail and would drop it."""
    if top_p >= 1:
        return probs
    ordered, order = probs.sort(descending=True)
    mass_before = ordered.double().cumsum(0) - ordered.double()  # fp32's sum over 128k ids moved the cut
    ordered = ordered.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(0, order, ordered)


def next_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator) -> int:
    """The token that follows, from the last position's logits [vocab]."""
    if sampling.temperature == 0:
        return int(logits.argmax())
    logits = logits.float()
    # Shifted first: a tiny temperature turns the top logit into 0 and the rest into -inf, never inf - inf.
    probs = torch.softmax((logits - logits.max()) / sampling.temperature, dim=-1)
    return int(torch.multinomial(top_p_filter(probs, sampling.top_p), 1, generator=generator))


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new_tokens: int, stop_ids: Collection[int],
             sampling: Sampling = Sampling(), vocab_size: int | None = None) -> list[int]:
    """The ids that follow `prompt`: up to max_new_tokens, ending early with one of `stop_ids` (included)
    when it is generated. Only ids below `vocab_size` (the tokenizer's; the model's table may be padded
    past it) are ever chosen."""
    if not prompt:
        raise ValueError("generation needs a prompt of at least one token")
    if max_new_tokens <= 0:
        return []
    device = next(model.parameters()).device
    cache = KVCache(model, batch=1, capacity=len(prompt) + max_new_tokens)
    # Drawn on the CPU: the same seed samples the same tokens from the same logits on any device.
    generator = torch.Generator().manual_seed(sampling.seed)
    tokens, new = torch.tensor([prompt], device=device), []
    while True:
        logits = forward_cached(model, tokens, cache)[0, -1, :vocab_size].float().cpu()
        new.append(next_token(logits, sampling, generator))
        if new[-1] in stop_ids or len(new) == max_new_tokens:
            return new
        tokens = torch.tensor([[new[-1]]], device=device)
