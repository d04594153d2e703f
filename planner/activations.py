"""Activation bytes of one microbatch, traced: the model's own forward on the meta device, with autograd's
saved-tensor hooks counting every tensor it saves for backward, once per storage, parameters excluded.
That is what `mem_snapshot_stop_step` counts on CPU as activations, by the same mechanism.

A chunk is traced with one and with two blocks: their difference is one block's bytes, the rest what a
chunk holds whatever its depth (its input, the rotary tables); chunks with the embedding or the output head
(and the loss) add theirs. Every TP / CP collective runs on a fake process group (fake_world.py).
"""

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.autograd.graph import saved_tensors_hooks

from model.transformer import Transformer
from parallel.tensor_parallel import vocab_parallel_cross_entropy
from planner import fake_world
from trainer.config.schema import ModelConfig
from trainer.parallelize import apply_activation_checkpointing


@dataclass(frozen=True)
class ActivationKey:
    """Everything a microbatch's saved tensors depend on."""

    model: ModelConfig
    tp: int
    cp: int
    sequence_parallel: bool
    cp_comm: str
    microbatch: int
    seq_len: int
    dtype: torch.dtype


@dataclass(frozen=True)
class ChunkActivations:
    """Bytes one microbatch leaves saved for backward, by part of a chunk."""

    block: int  # per transformer block
    chunk: int  # per chunk, whatever its blocks (its input, the rotary tables)
    embedding: int  # the first chunk's embedding
    head: int  # the last chunk's norm and output projection
    loss: int  # the loss over the head's logits (freed by the loss's backward, before the head's)


class _SavedBytes:
    """Saved-tensor hooks summing each storage's bytes once (meta storages have no address: their
    identity is the storage object's)."""

    def __init__(self, parameters: set[int]):
        self.parameters, self.seen, self.total = parameters, set(), 0
        self.hooks = saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self.seen and key not in self.parameters:
            self.seen.add(key)
            self.total += storage.nbytes()
        return t


def _trace(key: ActivationKey, blocks: int, embedding: bool, head: bool, loss: bool = False) -> int:
    tp = fake_world.tp_context(key.tp, key.sequence_parallel)
    cp = fake_world.cp_context(key.tp, key.cp, key.cp_comm)
    with torch.device("meta"):
        model = Transformer(key.model, tp, range(blocks), embedding=embedding, head=head, cp=cp).to(key.dtype)
    apply_activation_checkpointing(model, key.model.layer_ckpt)
    seq = key.seq_len // key.cp
    if embedding:
        x = torch.zeros(key.microbatch, seq, dtype=torch.long, device="meta")
    else:
        local = seq // key.tp if tp.sequence_parallel else seq
        x = torch.empty(key.microbatch, local, key.model.dim, dtype=key.dtype, device="meta", requires_grad=True)
    saved = _SavedBytes({p.untyped_storage()._cdata for p in model.parameters()})
    with saved.hooks:
        y = model(x)
        if loss:
            targets = torch.zeros(key.microbatch, seq, dtype=torch.long, device="meta")
            vocab_parallel_cross_entropy(y, targets, tp, key.model.valid_vocab_size).sum()
    return saved.total


@lru_cache(maxsize=1024)
def chunk_activations(key: ActivationKey) -> ChunkActivations:
    """One microbatch's saved bytes per block, per chunk, for the embedding, the head and the loss."""
    one, two = _trace(key, 1, False, False), _trace(key, 2, False, False)
    head = _trace(key, 1, False, True)
    return ChunkActivations(block=two - one, chunk=2 * one - two, embedding=_trace(key, 1, True, False) - one,
                            head=head - one, loss=_trace(key, 1, False, True, loss=True) - head)
