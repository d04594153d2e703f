"""Activation bytes of one microbatch, traced: the model's own forward on the meta device, with autograd's
saved-tensor hooks counting every tensor it saves for backward, once per storage, parameters excluded.
That is what `mem_snapshot_stop_step` counts on CPU as activations, by the same mechanism.

One trace of a chunk with the embedding, two blocks, the head and the loss: each saved storage counts for
the part whose forward saved it first. The second block's bytes are every block's; what the first block
saves beyond them (its input's rotary tables) a chunk holds whatever its depth; the loss's bytes are
those saved outside every module. Microbatches scale them linearly (one sequence is traced). Every TP /
CP collective runs on a fake process group (fake_world.py).

The loss's scratch, which autograd does not save, comes from the same trace: the bytes of every live
storage as ops make and drop them (live_bytes.py), at their peak in the loss's forward and in its
backward (down to the logits' gradient) over what it leaves saved: the fp32 logits, their shifted and
exponentiated copies, the softmax gradient. The runtime drops the logits once the loss has them.
"""

from dataclasses import dataclass, fields
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch.autograd import Variable
from torch.autograd.graph import saved_tensors_hooks
from torch.overrides import TorchFunctionMode

from model.transformer import Transformer
from parallel.cross_entropy import vocab_parallel_cross_entropy
from parallel.tensor_parallel import TPContext
from planner import fake_world
from planner.live_bytes import LiveBytes
from trainer.config.schema import ModelConfig
from trainer.parallelize import apply_activation_checkpointing

PARTS = ("tok_embeddings", "layers.0", "layers.1", "head")


@dataclass(frozen=True)
class ActivationKey:
    """Everything one sequence's saved tensors depend on."""

    model: ModelConfig
    tp: int
    cp: int
    sequence_parallel: bool
    cp_comm: str
    seq_len: int
    dtype: torch.dtype


@dataclass(frozen=True)
class ChunkActivations:
    """Bytes one microbatch leaves saved for backward, by part of a chunk."""

    block: int  # per transformer block
    chunk: int  # per chunk, whatever its blocks (the rotary tables)
    embedding: int  # the first chunk's embedding
    head: int  # the last chunk's norm and output projection
    loss: int  # the loss over the head's logits (freed by the loss's backward, before the head's)
    loss_forward: int = 0  # the loss forward's peak of live bytes beyond `loss` (the logits included)
    loss_backward: int = 0  # the loss backward's peak of live bytes beyond `loss`

    def times(self, microbatch: int) -> "ChunkActivations":
        return ChunkActivations(*(microbatch * getattr(self, f.name) for f in fields(self)))


class _SavedBytes:
    """Saved-tensor hooks summing each storage's bytes once, for the part running when it is first saved
    (meta storages have no address: their identity is the storage object's)."""

    def __init__(self, parameters: set[int]):
        self.parameters, self.seen = parameters, set()
        self.part, self.bytes = "outside", {p: 0 for p in (*PARTS, "outside")}
        self.hooks = saved_tensors_hooks(self.pack, lambda t: t)

    def enter(self, part: str) -> None:
        self.part = part

    def leave(self) -> None:
        self.part = "outside"

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.seen and key not in self.parameters:
            self.seen.add(key)
            self.bytes[self.part] += storage.nbytes()
        return t


class FusedAttention(TorchFunctionMode):
    """Causal sdpa as a device runs it: the flash kernel (CPU's and CUDA's save the same: q, k, v, the
    output and its log-sum-exp). On the meta device sdpa would take its math path, which saves the
    seq x seq scores no device keeps."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and kwargs.get("is_causal") and kwargs.get("attn_mask") is None:
            q, k, v = args[:3]
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)[0]
        return func(*args, **kwargs)


@lru_cache(maxsize=1024)
def sequence_activations(key: ActivationKey) -> ChunkActivations:
    """One sequence's saved bytes per block, per chunk, for the embedding, the head and the loss, and the
    loss's scratch."""
    with fake_world.started():
        return _trace(key)


def traced_model(key: ActivationKey) -> tuple[Transformer, TPContext, torch.Tensor]:
    """The chunk a trace runs (embedding, two blocks, head) on the meta device, its TP context and one
    sequence's tokens, inside fake_world.started()."""
    tp = fake_world.tp_context(key.tp, key.sequence_parallel)
    cp = fake_world.cp_context(key.tp, key.cp, key.cp_comm)
    with torch.device("meta"):
        model = Transformer(key.model, tp, range(2), embedding=True, head=True, cp=cp).to(key.dtype)
    apply_activation_checkpointing(model, key.model.layer_ckpt)
    return model, tp, torch.zeros(1, key.seq_len // key.cp, dtype=torch.long, device="meta")


def _trace(key: ActivationKey) -> ChunkActivations:
    model, tp, tokens = traced_model(key)
    saved = _SavedBytes({p.untyped_storage()._cdata for p in model.parameters()})
    for part in PARTS:
        module = model.get_submodule(part)
        module.register_forward_pre_hook(lambda m, args, part=part: saved.enter(part))
        module.register_forward_hook(lambda m, args, out: saved.leave())
    live = LiveBytes()
    with FusedAttention(), live:
        with saved.hooks:
            logits = model(tokens)
            live.reset_peak()
            loss = vocab_parallel_cross_entropy(logits, tokens, tp, key.model.valid_vocab_size).sum()
        forward_peak = live.peak
        # The runtime drops the logits once the loss has them; the loss's backward ends at their gradient
        # (the engine itself, down to the logits only: Tensor.backward would run in the mode's handler).
        live.reset_peak()
        left = live.live - _storage_nbytes(logits)
        Variable._execution_engine.run_backward((loss,), (torch.ones_like(loss),), False, False, (logits,), True, False)
        backward_peak = live.peak - _storage_nbytes(logits)
    b = saved.bytes
    return ChunkActivations(block=b["layers.1"], chunk=b["layers.0"] - b["layers.1"], embedding=b["tok_embeddings"],
                            head=b["head"], loss=b["outside"], loss_forward=forward_peak - left,
                            loss_backward=backward_peak - left)


def _storage_nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def chunk_activations(key: ActivationKey, microbatch: int) -> ChunkActivations:
    return sequence_activations(key).times(microbatch)
