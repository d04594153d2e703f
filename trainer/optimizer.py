"""AdamW over the model's parameters (FSDP's fp32 flat shards), the LR schedule, and clipping.

Optimizer state is keyed by parameter name, so checkpoints do not depend on parameter order. Weight
decay applies to every parameter (as torchtitan does): a flat shard mixes matrices and norm weights.
"""

import math

import torch
from torch import nn

from trainer.config.schema import OptimConfig

ADAM_STATE = ("exp_avg", "exp_avg_sq")


class NamedAdamW:
    """AdamW (decoupled weight decay) over named parameters, step for step the arithmetic of
    torch.optim.AdamW's single-tensor path (tests/unit/trainer/test_optim_flops.py holds them bitwise equal).

    In-tree rather than torch.optim: constructing a torch.optim.Optimizer imports torch._dynamo, 1.4 s
    of every process's start-up, and there are only a few flat fp32 shards to step."""

    def __init__(self, modules: list[nn.Module], cfg: OptimConfig):
        """`modules` hold disjoint parameters under distinct names (pipeline chunks of one model)."""
        named = [(n, p) for m in modules for n, p in m.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.cfg = cfg
        self._state: dict[str, dict[str, torch.Tensor]] = {}

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    @torch.no_grad()
    def step(self, lr: float) -> None:
        if self.cfg.fused:
            self._fused_step(lr)
            return
        beta1, beta2, cfg = self.cfg.beta1, self.cfg.beta2, self.cfg
        state = self.state()
        for name, param in zip(self.names, self.params):
            if param.grad is None:
                continue
            slot = state[name]
            slot["step"] += 1
            param.mul_(1 - lr * cfg.weight_decay)
            slot["exp_avg"].lerp_(param.grad, 1 - beta1)
            slot["exp_avg_sq"].mul_(beta2).addcmul_(param.grad, param.grad, value=1 - beta2)
            step = slot["step"].item()
            bias_correction2_sqrt = (1 - beta2**step) ** 0.5
            denom = (slot["exp_avg_sq"].sqrt() / bias_correction2_sqrt).add_(cfg.eps)
            param.addcdiv_(slot["exp_avg"], denom, value=-lr / (1 - beta1**step))

    def _fused_step(self, lr: float) -> None:
        """The same update as torch.optim.AdamW(fused=True): one kernel pass per parameter (parameter,
        gradient and both moments read once, written once) instead of eight elementwise passes."""
        cfg, state = self.cfg, self.state()
        stepping = [(name, p) for name, p in zip(self.names, self.params) if p.grad is not None]
        if not stepping:
            return
        slots = [state[name] for name, _ in stepping]
        steps = [slot["step"] for slot in slots]
        torch._foreach_add_(steps, 1)
        torch._fused_adamw_([p for _, p in stepping], [p.grad for _, p in stepping], [s["exp_avg"] for s in slots],
                            [s["exp_avg_sq"] for s in slots], [], steps, lr=lr, beta1=cfg.beta1, beta2=cfg.beta2,
                            weight_decay=cfg.weight_decay, eps=cfg.eps, amsgrad=False, maximize=False)
        # The kernel writes in place without bumping version counters, which an FSDP unit left unsharded
        # reads to know its gathered weights are stale (the single-tensor path's in-place ops bump them).
        torch.autograd.graph.increment_version([p for _, p in stepping])

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def updates(self) -> int:
        """How many updates this optimizer has made (all parameters step together)."""
        return max((int(slot["step"]) for slot in self._state.values()), default=0)

    def allocated_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The state that exists so far (none before the first step or load); allocates nothing, so an
        observer (the memory breakdown) does not change what it measures."""
        return self._state

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """{name: {step, exp_avg, exp_avg_sq}}; zero-filled before the first step (for loading into). The fused
        kernel reads the step counts on the parameters' device (a CUDA kernel given a CPU tensor's address
        would read garbage), the single-tensor path on the host, as torch.optim keeps them."""
        for name, p in zip(self.names, self.params):
            if name not in self._state:
                step = torch.zeros((), device=p.device if self.cfg.fused else "cpu")
                self._state[name] = {"step": step} | {
                    k: torch.zeros_like(p, memory_format=torch.preserve_format) for k in ADAM_STATE}
        return self._state


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """LR of 1-based `step`: linear warmup to cfg.lr, held there until cfg.decay_start (default: the end
    of warmup), then a cosine or linear decay (cfg.decay_style) to cfg.lr * min_lr_ratio at step
    cfg.decay_steps (default: the run's last step)."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    start = cfg.decay_start if cfg.decay_start is not None else cfg.warmup_steps
    end = cfg.decay_end(total_steps)
    progress = min(max(step - start, 0) / max(end - start, 1), 1.0)
    min_lr = cfg.lr * cfg.min_lr_ratio
    if cfg.decay_style == "linear":
        return min_lr + (cfg.lr - min_lr) * (1.0 - progress)
    return min_lr + (cfg.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def clip_grads(grads: list[torch.Tensor], norm: float, max_norm: float) -> None:
    """Scale grads in place so their global L2 norm `norm` becomes at most max_norm (0 = no clipping)."""
    if max_norm <= 0:
        return
    scale = min(max_norm / (norm + 1e-6), 1.0)
    if scale < 1.0:
        for g in grads:
            g.mul_(scale)
