"""AdamW (bitwise torch.optim.AdamW), LR schedule and clipping; model FLOPs against torch's own FLOP counter."""

import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from model.args import ModelArgs
from model.init import init_weights
from model.transformer import Transformer
from parallel import comm
from trainer.config.schema import OptimConfig
from trainer.observability.flops import device_peak_flops, training_flops_per_token
from trainer.optimizer import NamedAdamW, clip_grads, lr_at
from trainer.step import StepRunner, token_loss_sum


def test_lr_warmup_then_cosine_to_min():
    cfg = OptimConfig(lr=1.0, warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_at(s, 20, cfg) for s in (1, 2, 4)] == [0.25, 0.5, 1.0]
    assert lr_at(12, 20, cfg) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(20, 20, cfg) == pytest.approx(0.1)
    # decay_steps decouples the schedule from this run's length (stop at 10 of a 20-step schedule).
    assert lr_at(10, 10, OptimConfig(lr=1.0, warmup_steps=4, decay_steps=20)) == lr_at(10, 20, cfg)


def test_warmup_stable_decay_and_the_linear_shape():
    wsd = OptimConfig(lr=1.0, warmup_steps=4, decay_start=10, decay_steps=20, min_lr_ratio=0.2, decay_style="linear")
    assert [lr_at(s, 30, wsd) for s in (2, 4, 7, 10)] == [0.5, 1.0, 1.0, 1.0]  # warmup, then stable
    assert [lr_at(s, 30, wsd) for s in (15, 20, 25)] == pytest.approx([0.6, 0.2, 0.2])  # linear to the minimum
    cosine = OptimConfig(lr=1.0, warmup_steps=4, decay_start=10, decay_steps=20, min_lr_ratio=0.2)
    assert lr_at(15, 30, cosine) == pytest.approx(0.2 + 0.8 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    # decay_start at the end of warmup is the default schedule, bit for bit.
    default, explicit = OptimConfig(lr=1e-3, warmup_steps=4), OptimConfig(lr=1e-3, warmup_steps=4, decay_start=4)
    assert [lr_at(s, 37, default) for s in range(1, 38)] == [lr_at(s, 37, explicit) for s in range(1, 38)]


def test_a_step_at_lr_0_leaves_the_weights_bitwise_unchanged():
    """Decoupled weight decay is lr x weight_decay: 0 too, so optim.lr=0 freezes the model."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = NamedAdamW([model], OptimConfig(lr=0.0, weight_decay=0.1))
    for _ in range(3):
        model(torch.randn(5, 8)).square().sum().backward()
        optimizer.step(lr_at(1, 10, optimizer.cfg))
        optimizer.zero_grad()
    assert optimizer.updates() == 3
    for name, param in model.named_parameters():
        assert torch.equal(param.detach().view(torch.int32), before[name].view(torch.int32)), name


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


@pytest.mark.parametrize("dim, n_heads", [(64, 4), (100, 6)])  # 6 heads of 16 = 96, not dim
def test_flops_formula_matches_torch_flop_counter(dim: int, n_heads: int):
    # The math attention path: torch's counter has no formula for the CPU flash-attention kernel.
    args = ModelArgs(n_layers=2, dim=dim, n_heads=n_heads, n_kv_heads=n_heads // 2, vocab_size=128, max_seq_len=32,
                     efficient_attn="math")
    model = Transformer(args)
    init_weights(model, args, seed=0)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    with FlopCounterMode(display=False) as counter:
        token_loss_sum(model(tokens), tokens).backward()
    assert counter.get_total_flops() / tokens.numel() == pytest.approx(training_flops_per_token(args, 32), rel=1e-9)


@pytest.mark.parametrize("name, peak", [
    ("NVIDIA H100 80GB HBM3", 989.5e12), ("NVIDIA H100 NVL", 835.5e12), ("NVIDIA H100 PCIe", 756.0e12),
    ("NVIDIA H200", 989.5e12), ("NVIDIA H200 NVL", 835.5e12), ("NVIDIA A100-SXM4-80GB", 312.0e12),
    ("NVIDIA GeForce RTX 4090", None),
])
def test_peak_flops_by_device_name(monkeypatch, name: str, peak: float | None):
    """The most specific entry wins: an NVL or PCIe card is not counted at the SXM part's peak."""
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert device_peak_flops(torch.device("cuda")) == peak
    assert device_peak_flops(torch.device("cpu")) is None


def test_tflops_compute_leaves_out_the_time_blocked_on_communication(monkeypatch):
    """Both TFLOP/s from the FLOP formula: end to end over the step time, and over the time not spent
    blocked on communication (the ledger's exposed-comm total)."""
    args = ModelArgs(n_layers=2, dim=64, n_heads=4, n_kv_heads=2, vocab_size=512, max_seq_len=128)
    per_token = training_flops_per_token(args, 128)
    trainer = SimpleNamespace(global_tokens=4 * 128, flops_per_token=per_token, mesh=SimpleNamespace(
        dims=SimpleNamespace(world_size=2)), peak_flops=None, device=torch.device("cpu"),
        optimizer=SimpleNamespace(updates=lambda: 1))
    comm.LEDGER.reset()
    monkeypatch.setattr(comm.LEDGER.wait_clock, "total_s", lambda: 0.25)
    m = StepRunner._metrics(trainer, step=1, loss=1.0, grad_norm=1.0, lr=1e-3, elapsed=1.0)
    monkeypatch.undo()
    comm.LEDGER.reset()
    assert m.tflops == pytest.approx(per_token * 4 * 128 / 2 / 1e12)
    assert m.tflops_compute == pytest.approx(m.tflops / 0.75) and m.tflops_compute >= m.tflops
    assert m.comm_wait_s == 0.25
    assert m.mfu is None and m.mfu_compute is None  # a device with no known peak
    for elapsed in (0.0123456789, 0.3, 1.7, 2.9e-3):  # no wait: the same number, not one ulp below
        m = StepRunner._metrics(trainer, step=1, loss=1.0, grad_norm=1.0, lr=1e-3, elapsed=elapsed)
        assert m.tflops_compute == m.tflops and m.comm_wait_s == 0

    trainer.peak_flops = 2e9  # MFU: each device's achieved FLOP/s over its peak
    monkeypatch.setattr(comm.LEDGER.wait_clock, "total_s", lambda: 0.5)
    m = StepRunner._metrics(trainer, step=1, loss=1.0, grad_norm=1.0, lr=1e-3, elapsed=2.0)
    comm.LEDGER.reset()
    assert m.mfu == pytest.approx(per_token * 4 * 128 / 2 / 2.0 / 2e9)
    assert m.mfu_compute == pytest.approx(m.mfu * 2.0 / 1.5)


def adamw_against_torch(fused: bool, device: str, steps: int = 7) -> None:
    """Our in-tree AdamW against torch.optim.AdamW over `steps` steps with changing LR, bitwise: its
    single-tensor path, or with optim.fused its fused kernel (tests/gpu runs this on CUDA too)."""
    cfg = OptimConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8, fused=fused)
    gen = torch.Generator().manual_seed(0)
    ours_model = torch.nn.Linear(8, 4).to(device)
    theirs = [p.detach().clone().requires_grad_() for p in ours_model.parameters()]
    ours = NamedAdamW([ours_model], cfg)
    reference = torch.optim.AdamW(theirs, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                  weight_decay=cfg.weight_decay, foreach=False, fused=fused or None)
    for step in range(1, steps + 1):
        lr = lr_at(step, steps, cfg)
        for p, q in zip(ours.params, theirs):
            p.grad = torch.randn(p.shape, generator=gen).to(device)
            q.grad = p.grad.clone()
        ours.step(lr)
        for group in reference.param_groups:
            group["lr"] = lr
        reference.step()
        for p, q in zip(ours.params, theirs):
            assert torch.equal(p.detach(), q.detach()), step
    state = ours.state()["weight"]
    assert torch.equal(state["exp_avg_sq"], reference.state[theirs[0]]["exp_avg_sq"])
    assert state["step"].item() == steps and ours.updates() == steps


@pytest.mark.parametrize("fused", [False, True])
def test_adamw_is_torch_adamw_bitwise(fused: bool):
    adamw_against_torch(fused, "cpu")


def test_the_fused_update_is_the_default_one_up_to_rounding_and_skips_parameters_without_gradients():
    gen = torch.Generator().manual_seed(1)
    models = [torch.nn.Linear(64, 32), torch.nn.Linear(64, 32)]
    models[1].load_state_dict(models[0].state_dict())
    optimizers = [NamedAdamW([m], OptimConfig(fused=fused)) for m, fused in zip(models, (False, True))]
    for step in range(1, 6):
        grad = torch.randn(32, 64, generator=gen)
        for m, optimizer in zip(models, optimizers):
            m.weight.grad, m.bias.grad = grad.clone(), None  # the bias gets none: it must not move
            optimizer.step(1e-2)
    default, fused = (m.weight.detach() for m in models)
    torch.testing.assert_close(fused, default, rtol=1e-5, atol=1e-7)
    assert torch.equal(models[1].bias, models[0].bias) and optimizers[1].state()["bias"]["step"].item() == 0


def test_the_fused_kernels_step_counts_live_on_the_parameters_device():
    """torch._fused_adamw_ dereferences each step count on the parameters' device: on CUDA, a CPU count's
    address would be read as device memory. (The meta device stands in for CUDA here.)"""
    with torch.device("meta"):
        modules = [torch.nn.Linear(4, 4)]
    fused = NamedAdamW(modules, OptimConfig(fused=True)).state()
    plain = NamedAdamW(modules, OptimConfig(fused=False)).state()
    assert {slot["step"].device.type for slot in fused.values()} == {"meta"}
    assert {slot["step"].device.type for slot in plain.values()} == {"cpu"}
