"""One optimizer step on this rank: the pipeline runs the step's microbatches, then one gradient sync,
the norm, clipping and AdamW; also evaluation's forwards, and a step's metrics.

The pipeline runtime (also with one stage, where its 1F1B program is forward, backward, forward, ...)
is the microbatch scheduler of the FSDP protocol: it marks each chunk's first and last microbatch,
so every chunk reduces its gradients once per step, during its own last backward.

Each microbatch's loss is its token-loss sum divided by the token count of the whole global batch,
so accumulated and data-parallel-summed gradients are those of the global mean loss, and the logged
loss is the same number for every layout.
"""

import math
import time
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import nn
from torch.distributed import ProcessGroup

from model.fp8 import WEIGHT, Fp8Gemm, discard_step_amaxes, fp8_gemms, note_set_scales, update_scaling
from parallel import comm
from parallel.cross_entropy import vocab_parallel_cross_entropy
from parallel.fsdp import FSDPRoot, grad_norm, sum_tied_grads, unit_norms
from parallel.mesh import ParallelMesh
from parallel.pipeline.runtime import ChunkKwargs, PipelineRuntime
from parallel.regional_compile import reset_compilation
from parallel.tensor_parallel import TPContext
from trainer.config.schema import TrainConfig
from trainer.data.loader import BatchLoader
from trainer.observability.flops import device_peak_flops, training_flops_per_token
from trainer.observability.metrics import StepMetrics, peak_memory_gib, start_memory_peak
from trainer.optimizer import NamedAdamW, clip_grads, lr_at
from trainer.parallelize import (block_factory, build_chunks, build_runtime, check_device_kernels, compute_dtype,
                                 cp_context, model_unit_names, parallelize, tp_context)
from trainer.resilience.nonfinite import first_nonfinite_unit, halt_message


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, tp: TPContext | None = None,
                   valid_vocab_size: int | None = None) -> torch.Tensor:
    """Sum of next-token cross-entropy over all tokens, in fp32, from (vocab-sharded) logits; the columns
    from `valid_vocab_size` on (a padded vocabulary's) are masked out."""
    return vocab_parallel_cross_entropy(logits, targets, tp or TPContext(), valid_vocab_size).sum()


@dataclass
class StepRunner:
    """This rank's built model (chunks, FSDP roots, pipeline program) and optimizer, and what one step does
    with them. The run's lifecycle around it is trainer.trainer.Trainer's."""

    cfg: TrainConfig
    mesh: ParallelMesh
    chunks: list[nn.Module]  # this pipeline rank's model chunks
    roots: list[FSDPRoot]  # their FSDP roots
    runtime: PipelineRuntime
    optimizer: NamedAdamW
    loader: BatchLoader
    device: torch.device
    flops_per_token: float
    peak_flops: float | None
    eval_loader: BatchLoader | None = None  # held-out batches (eval.freq > 0)
    tied_group: ProcessGroup | None = None  # the ranks holding this rank's tied embedding's other copy
    _fp8_scaling_started: bool = field(default=False, init=False)

    @classmethod
    def build(cls, cfg: TrainConfig, mesh: ParallelMesh, loader: BatchLoader, device: torch.device,
              eval_loader: BatchLoader | None = None) -> "StepRunner":
        """This rank's model chunks (TP-shaped, FSDP-sharded, initialized), optimizer and pipeline program."""
        dtype = compute_dtype(cfg, device)
        check_device_kernels(cfg, mesh, device, dtype)
        if cfg.compile:
            reset_compilation()  # compiled graphs and counts belong to the model built here
        chunks = build_chunks(cfg, tp_context(cfg, mesh), mesh.rank_in("pp"), cp_context(cfg, mesh),
                              block_factory(cfg, mesh))
        roots = [parallelize(chunk, cfg, mesh, dtype, device) for chunk in chunks]
        return cls(cfg, mesh, chunks, roots, build_runtime(cfg, mesh, chunks, roots, dtype, device),
                   NamedAdamW(chunks, cfg.optim), loader, device,
                   flops_per_token=training_flops_per_token(cfg.model, cfg.seq_len),
                   peak_flops=device_peak_flops(device), eval_loader=eval_loader,
                   tied_group=mesh.embedding_group() if cfg.model.tie_embeddings else None)

    @cached_property
    def fp8_gemms(self) -> list[Fp8Gemm]:
        """This rank's fp8 GEMMs, in model order (found once: the model does not change)."""
        return fp8_gemms(self.chunks)

    def start_fp8_scaling(self) -> None:
        """Before the first pass of the process (after any checkpoint load), once, outside any step's
        ledger. Fresh fp8 scaling (no weight scale set yet: not resumed) starts with a "step 0" that
        records only the weights' amaxes and updates the scales from them, so step 1 casts the weights
        with a recipe scale instead of 1 (model/fp8.py); weight scales are identical over the amax
        group, so every rank of it takes the same branch. A resumed run's gemms learn which of their
        loaded scales are set."""
        if self._fp8_scaling_started or not self.fp8_gemms:
            return
        self._fp8_scaling_started = True
        if any(bool(g.scale_is_set[WEIGHT]) for g in self.fp8_gemms):
            note_set_scales(self.fp8_gemms)
            return
        for root in self.roots:
            root.record_fp8_weight_amaxes()
        update_scaling(self.fp8_gemms, self.mesh.group("dp_cp_tp"))

    @property
    def valid_vocab_size(self) -> int | None:
        """The tokenizer's ids: the logits past them are padding, masked out of the loss."""
        return self.cfg.model.valid_vocab_size

    @property
    def global_tokens(self) -> int:
        """The loss's (and gradient's) divisor: every target of the global batch. The loader never masks
        a target (IGNORE_INDEX); a data path that does must divide by the step's unmasked count instead,
        or the loss, eval loss and effective learning rate shrink with the masked share."""
        return self.cfg.batch_size * self.mesh.dims.dp * self.cfg.seq_len

    def train_step(self, step: int) -> StepMetrics:
        """Run optimizer step `step` (1-based) and return its metrics."""
        self.start_fp8_scaling()
        start_memory_peak(self.device)
        start = time.perf_counter()
        comm.LEDGER.reset(step)
        comm.set_phase("forward and backward")
        loss_sum = self._forward_backward(step)
        comm.set_phase("gradient sync, norm and optimizer step")
        for root in self.roots:
            root.finish_gradient_sync()
        # The tied embedding's copies on the first and last stages take one update (Megatron's embedding all-reduce).
        sum_tied_grads(self.roots, self.tied_group)
        norm = grad_norm(self.roots, [self.mesh.group("pp_dp_shard_cp_tp")])
        per_unit = unit_norms(self.roots, model_unit_names(self.cfg.model.n_layers),
                              self.mesh.group("pp_dp_shard_cp_tp")) if self.cfg.metrics.unit_norms else None
        loss_group = self.mesh.group("pp_dp_cp")
        if loss_group.size() > 1:  # the last stage's sums over its data; other stages add zero
            comm.all_reduce(loss_sum, loss_group)
        loss = loss_sum.item() / self.global_tokens
        lr = lr_at(step, self.cfg.steps, self.cfg.optim)
        # Every rank holds the same reduced loss and norm: all ranks take the same branch.
        if math.isfinite(norm) and math.isfinite(loss):
            update_scaling(self.fp8_gemms, self.mesh.group("dp_cp_tp"))
            clip_grads(self.optimizer.grads(), norm, self.cfg.optim.clip_grad_norm)
            self.optimizer.step(lr)
        elif self.cfg.nan_policy == "skip":
            discard_step_amaxes(self.fp8_gemms)  # a skipped step's (non-finite) amaxes never enter the history
        else:
            unit = first_nonfinite_unit(self.roots, self.runtime.stages)
            raise FloatingPointError(halt_message(step, loss, norm, unit))
        self.optimizer.zero_grad()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - start
        return self._metrics(step, loss, norm, lr, elapsed, per_unit)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over eval.steps held-out global batches: the pipeline's forwards only, the
        same tokens for every layout. Leaves no trace in training: units end resharded and the fp8
        amaxes the forwards recorded are dropped (they belong to no step)."""
        self.start_fp8_scaling()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        tp = self.chunks[-1].tp
        for batch in range(self.cfg.eval.steps):
            full, microbatches = self._read_batch(self.eval_loader, batch)

            def loss(logits: torch.Tensor, mb: int) -> torch.Tensor:
                nonlocal loss_sum
                mb_loss = token_loss_sum(logits, microbatches[mb][1], tp, self.valid_vocab_size)
                loss_sum += mb_loss.double()
                return mb_loss

            self.runtime.run_forward(lambda mb: microbatches[mb][0], loss,
                                     self._chunk_kwargs(self.eval_loader, full))
        for root in self.roots:
            root.reshard()
        discard_step_amaxes(self.fp8_gemms)
        loss_group = self.mesh.group("pp_dp_cp")
        if loss_group.size() > 1:
            comm.all_reduce(loss_sum, loss_group)
        return loss_sum.item() / (self.global_tokens * self.cfg.eval.steps)

    def _cp_shards(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This CP rank's share of each sequence (tokens and targets alike), cut once per step. The loss
        divides by global_tokens, computed from the config: a loader that handed over other shapes
        would scale the loss and every gradient wrongly without a word, so the shapes are checked."""
        expected = (self.cfg.num_microbatches, (self.cfg.microbatch_size, self.cfg.seq_len))
        got = (len(microbatches), {tuple(t.shape) for pair in microbatches for t in pair})
        if got != (expected[0], {expected[1]}):
            raise RuntimeError(f"the loader gave {got[0]} microbatches of shapes {sorted(got[1])}; the config needs "
                               f"{expected[0]} of {expected[1]} (microbatch_size x seq_len)")
        cp = self.chunks[0].cp
        return [(cp.shard(tokens), cp.shard(targets)) for tokens, targets in microbatches]

    def _forward_backward(self, step: int) -> torch.Tensor:
        """Run the step's pipeline program; returns this rank's token-loss sum (zero off the last stage)."""
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        full, microbatches = self._read_batch(self.loader, step - 1)
        tp = self.chunks[-1].tp

        def inputs(mb: int) -> torch.Tensor:
            return microbatches[mb][0]

        def loss(logits: torch.Tensor, mb: int) -> torch.Tensor:
            nonlocal loss_sum
            mb_loss = token_loss_sum(logits, microbatches[mb][1], tp, self.valid_vocab_size)
            loss_sum += mb_loss.detach().double()
            return mb_loss / self.global_tokens

        self.runtime.run_step(inputs, loss, self._chunk_kwargs(self.loader, full))
        return loss_sum

    @property
    def _block_causal(self) -> bool:
        return self.cfg.model.attn_bias_type == "block_causal"

    @property
    def _reads_batch(self) -> bool:
        """Only the first stage reads the inputs and only the last the targets; block_causal attention
        needs the documents on every stage."""
        return self._block_causal or any(c.tok_embeddings is not None or c.head is not None for c in self.chunks)

    def _read_batch(self, loader: BatchLoader, index: int) -> tuple[list, list]:
        """Batch `index`'s whole microbatches and this CP rank's cut of them; both empty on a stage that
        reads no batch."""
        if not self._reads_batch:
            return [], []
        full = loader.batch(index)
        return full, self._to_device(self._cp_shards(full))

    def _to_device(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
        """The step's microbatches on the device in one copy: on CUDA a copy from pageable host memory waits
        for the stream, and one per microbatch (inputs, then targets) drained the GPU's queue twice each."""
        on_device = torch.stack([torch.stack(pair) for pair in microbatches]).to(self.device)
        return [tuple(pair.unbind()) for pair in on_device.unbind()]

    def _chunk_kwargs(self, loader: BatchLoader, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> ChunkKwargs:
        """What every stage's chunk gets besides its input: block_causal's document ids, of the whole
        sequences (before any CP cut)."""
        if not self._block_causal:
            return lambda mb: {}
        ids = torch.stack([loader.document_ids(tokens) for tokens, _ in microbatches]).to(self.device).unbind()
        return lambda mb: {"document_ids": ids[mb]}

    def _metrics(self, step: int, loss: float, grad_norm: float, lr: float, elapsed: float,
                 per_unit: dict[str, dict[str, float]] | None = None) -> StepMetrics:
        tokens_per_s = self.global_tokens / elapsed
        flops_per_device = self.flops_per_token * tokens_per_s / self.mesh.dims.world_size
        wait_s = min(comm.LEDGER.wait_s, elapsed)
        computing_s = max(elapsed - wait_s, 1e-9)
        return StepMetrics(
            step=step,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            tokens_per_s=tokens_per_s,
            step_time_s=elapsed,
            tflops=flops_per_device / 1e12,
            # elapsed / computing_s >= 1 exactly, so the computing rate is never below the end-to-end one
            # by a rounding (a different order of operations could make it one ulp smaller).
            tflops_compute=flops_per_device / 1e12 * (elapsed / computing_s),
            comm_wait_s=wait_s,
            mfu=None if self.peak_flops is None else flops_per_device / self.peak_flops,
            mfu_compute=None if self.peak_flops is None else flops_per_device / self.peak_flops * (elapsed / computing_s),
            mem_peak_gib=peak_memory_gib(self.device),
            comm=comm.LEDGER.by_op(),
            # Steps that made no update (nan_policy=skip), counted from the optimizer's own step count,
            # which checkpoints carry: so the count survives a resume.
            skipped_steps=step - self.optimizer.updates(),
            unit_grad_norms=None if per_unit is None else per_unit["grad"],
            unit_param_norms=None if per_unit is None else per_unit["param"],
        )
