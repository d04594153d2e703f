"""LR schedule and clipping; model FLOPs against torch's own FLOP counter."""

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from model.args import ModelArgs
from model.init import init_weights
from model.transformer import Transformer
from trainer.config import OptimConfig
from trainer.flops import training_flops_per_token
from trainer.loop import token_loss_sum
from trainer.optimizer import clip_grads, lr_at


def test_lr_warmup_then_cosine_to_min():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_at(s, 20, cfg) for s in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert lr_at(12, 20, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(20, 20, cfg) == pytest.approx(0.1)
    # decay_steps decouples the schedule from this run's length (stop at 10 of a 20-step schedule).
    assert lr_at(10, 10, OptimConfig(lr=1.0, warmup_steps=4, decay_steps=20)) == lr_at(10, 20, cfg)


def test_clip_matches_torch():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(5, 3, generator=gen) * 10, torch.randn(7, generator=gen)]
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    expected = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    norm = torch.sqrt(sum(g.pow(2).sum() for g in grads)).item()
    assert norm == pytest.approx(expected.item(), rel=1e-6)
    clip_grads(grads, norm, max_norm=1.0)
    for p, g in zip(params, grads):
        torch.testing.assert_close(g, p.grad)
    unclipped = [g.clone() for g in grads]
    clip_grads(grads, 0.5, max_norm=1.0)  # already under the limit: untouched
    assert all(torch.equal(a, b) for a, b in zip(grads, unclipped))


def test_flops_formula_matches_torch_flop_counter():
    # The math attention path: torch's counter has no formula for the CPU flash-attention kernel.
    args = ModelArgs(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32, efficient_attn="math")
    model = Transformer(args)
    init_weights(model, args, seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    with FlopCounterMode(display=False) as counter:
        token_loss_sum(model(tokens), tokens).backward()
    assert counter.get_total_flops() / tokens.numel() == pytest.approx(training_flops_per_token(args, 32), rel=1e-9)
