"""LR schedule, clipping and the fp32 master copy; model FLOPs against torch's own FLOP counter."""

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
from trainer.optimizer import MasterAdamW, clip_grad_norm, lr_at


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
    norm = clip_grad_norm(grads, max_norm=1.0)
    assert norm == pytest.approx(expected.item(), rel=1e-6)
    for p, g in zip(params, grads):
        torch.testing.assert_close(g, p.grad)


def test_bf16_model_steps_fp32_masters():
    model = torch.nn.Linear(4, 4, bias=False).to(torch.bfloat16)
    opt = MasterAdamW(model, OptimConfig(lr=1e-3, weight_decay=0.0, use_fp32_copy_optim=True))
    assert opt.keeps_master and opt.params[0].dtype == torch.float32
    reference = torch.nn.Parameter(model.weight.detach().float().clone())
    ref_opt = torch.optim.AdamW([reference], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    for _ in range(3):
        model.weight.grad = torch.full_like(model.weight, 1e-4)  # too small to move a bf16 weight by itself
        reference.grad = model.weight.grad.float()
        opt.step(lr=1e-3)
        ref_opt.step()
    torch.testing.assert_close(opt.params[0], reference, rtol=0, atol=0)
    assert torch.equal(model.weight, reference.to(torch.bfloat16))


def test_flops_formula_matches_torch_flop_counter():
    # The math attention path: torch's counter has no formula for the CPU flash-attention kernel.
    args = ModelArgs(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=32, efficient_attn="math")
    model = Transformer(args)
    init_weights(model, args, seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    with FlopCounterMode(display=False) as counter:
        token_loss_sum(model(tokens), tokens).backward()
    assert counter.get_total_flops() / tokens.numel() == pytest.approx(training_flops_per_token(args, 32), rel=1e-9)
