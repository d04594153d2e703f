"""AdamW on fp32 parameters, the warmup + cosine LR schedule, and global-norm gradient clipping.

With a bf16 model and `optim.use_fp32_copy_optim=true`, the optimizer owns fp32 master copies: it
steps them with fp32 gradients and writes the rounded result back into the model. Optimizer state is
keyed by parameter name, so checkpoints do not depend on parameter order.
"""

import math

import torch
from torch import nn

from trainer.config import OptimConfig


class MasterAdamW:
    def __init__(self, model: nn.Module, cfg: OptimConfig):
        self.cfg = cfg
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.model_params = [p for _, p in named]
        self.keeps_master = cfg.use_fp32_copy_optim and any(p.dtype != torch.float32 for p in self.model_params)
        if self.keeps_master:
            self.params = [nn.Parameter(p.detach().float().clone()) for p in self.model_params]
        else:
            self.params = self.model_params
        decay = [p for p in self.params if p.ndim >= 2]
        no_decay = [p for p in self.params if p.ndim < 2]  # norm weights
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False,
        )

    def grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.model_params if p.grad is not None]

    def step(self, lr: float) -> None:
        if self.keeps_master:
            for master, p in zip(self.params, self.model_params):
                master.grad = None if p.grad is None else p.grad.float()
        for group in self.opt.param_groups:
            group["lr"] = lr
        self.opt.step()
        if self.keeps_master:
            with torch.no_grad():
                for master, p in zip(self.params, self.model_params):
                    p.copy_(master)

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
        if self.keeps_master:
            for p in self.params:
                p.grad = None

    def weights(self) -> dict[str, torch.Tensor]:
        """The fp32 weights by name: what checkpoints store."""
        return dict(zip(self.names, self.params))

    def state_dict(self) -> dict[str, dict[str, torch.Tensor]]:
        out = {}
        for name, p in zip(self.names, self.params):
            state = self.opt.state.get(p)
            if state:
                out[name] = {k: v for k, v in state.items()}
        return out

    def state_template(self) -> dict[str, dict[str, torch.Tensor]]:
        """Empty tensors shaped like a stepped optimizer's state, for checkpoint loading in place."""
        return {
            name: {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
            for name, p in zip(self.names, self.params)
        }

    def load_state(self, weights: dict[str, torch.Tensor], state: dict[str, dict[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, p, model_p in zip(self.names, self.params, self.model_params):
                p.copy_(weights[name])
                if self.keeps_master:
                    model_p.copy_(p)
                self.opt.state[p] = {k: v.clone() for k, v in state[name].items()}


def lr_at(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """LR of 1-based `step`: linear warmup to cfg.lr, then cosine to cfg.lr * min_lr_ratio at step
    cfg.decay_steps (default: the run's last step)."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    end = cfg.decay_steps if cfg.decay_steps is not None else total_steps
    decay_steps = max(end - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    min_lr = cfg.lr * cfg.min_lr_ratio
    return min_lr + (cfg.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def clip_grad_norm(grads: list[torch.Tensor], max_norm: float) -> float:
    """Scale grads in place so their global L2 norm is at most max_norm (0 = no clipping); returns the norm.

    Gradients here are complete on every rank (replicated after the data-parallel all-reduce), so the
    local norm is the global one.
    """
    total = torch.zeros((), dtype=torch.float32)
    for g in grads:
        total += g.float().pow(2).sum()
    norm = total.sqrt()
    if max_norm > 0:
        scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(scale.to(g.dtype))
    return norm.item()
