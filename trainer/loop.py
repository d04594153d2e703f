"""The optimizer-step loop: microbatches with gradient accumulation, one gradient sync, one step.

The loop is the microbatch scheduler of the FSDP protocol: it marks the first and last microbatch, so
gradients are reduced once per step, after the last microbatch's backward.

Each microbatch's loss is its token-loss sum divided by the token count of the whole global batch,
so accumulated and data-parallel-summed gradients are those of the global mean loss, and the logged
loss is the same number for every layout.
"""

import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from parallel import comm
from parallel.fsdp import FSDPRoot
from parallel.mesh import ParallelMesh
from parallel.tensor_parallel import TPContext, vocab_parallel_cross_entropy
from trainer.config import TrainConfig
from trainer.data import BatchLoader
from trainer.metrics import StepMetrics, peak_memory_gib
from trainer.optimizer import NamedAdamW, clip_grads, lr_at


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, tp: TPContext | None = None) -> torch.Tensor:
    """Sum of next-token cross-entropy over all tokens, in fp32, from (vocab-sharded) logits."""
    return vocab_parallel_cross_entropy(logits, targets, tp or TPContext()).sum()


@dataclass
class Trainer:
    cfg: TrainConfig
    mesh: ParallelMesh
    model: nn.Module
    fsdp: FSDPRoot
    optimizer: NamedAdamW
    loader: BatchLoader
    device: torch.device
    flops_per_token: float
    peak_flops: float | None

    @property
    def global_tokens(self) -> int:
        return self.cfg.batch_size * self.mesh.dims.dp * self.cfg.seq_len

    def train_step(self, step: int) -> StepMetrics:
        """Run optimizer step `step` (1-based) and return its metrics."""
        start = time.perf_counter()
        comm.LEDGER.reset()
        loss_sum = self._forward_backward(step)
        self.fsdp.finish_gradient_sync()
        grad_norm = self.fsdp.grad_norm()
        if not math.isfinite(grad_norm):  # every rank holds the same reduced norm: all stop together
            raise FloatingPointError(f"step {step}: gradient norm is {grad_norm}; stopping before the update")
        clip_grads(self.optimizer.grads(), grad_norm, self.cfg.optim.clip_grad_norm)
        lr = lr_at(step, self.cfg.steps, self.cfg.optim)
        self.optimizer.step(lr)
        self.optimizer.zero_grad()
        if self.mesh.dims.dp > 1:
            comm.all_reduce(loss_sum, self.mesh.group("dp"))
        loss = loss_sum.item() / self.global_tokens
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        return self._metrics(step, loss, grad_norm, lr, elapsed)

    def _forward_backward(self, step: int) -> torch.Tensor:
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        microbatches = self.loader.batch(step - 1)
        for i, (inputs, targets) in enumerate(microbatches):
            self.fsdp.set_microbatch(is_first=i == 0, is_last=i == len(microbatches) - 1)
            inputs, targets = inputs.to(self.device), targets.to(self.device)
            mb_loss = token_loss_sum(self.model(inputs), targets, self.model.tp)
            (mb_loss / self.global_tokens).backward()
            loss_sum += mb_loss.detach().double()
        return loss_sum

    def _metrics(self, step: int, loss: float, grad_norm: float, lr: float, elapsed: float) -> StepMetrics:
        tokens_per_s = self.global_tokens / elapsed
        flops_per_device = self.flops_per_token * tokens_per_s / self.mesh.dims.world_size
        return StepMetrics(
            step=step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            tokens_per_s=tokens_per_s,
            step_time_s=elapsed,
            tflops=flops_per_device / 1e12,
            mfu=None if self.peak_flops is None else flops_per_device / self.peak_flops,
            mem_peak_gib=peak_memory_gib(self.device),
            comm=comm.LEDGER.by_op(),
        )
