"""What a zero-bubble B leaves its W, traced: the chunk of activations.py runs forward and backward on the
meta device as a zero-bubble step runs it (parallel/weight_grads.py: every linear's weight-gradient GEMM
deferred to W, with the operands it reads: the linear's input and its output's gradient, the head's
logits gradient included). Those operands stay alive from B to W instead of being freed by B; the bytes
of the storages each part's queued GEMMs hold are found through their closures (live_bytes.py).
Microbatches scale them linearly (one sequence is traced).
"""

from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.autograd import Variable

from parallel import weight_grads
from parallel.cross_entropy import vocab_parallel_cross_entropy
from planner import fake_world
from planner.activations import PARTS, ActivationKey, FusedAttention, traced_model
from planner.live_bytes import captured, storage_bytes


@dataclass(frozen=True)
class DeferredOperands:
    """Bytes one microbatch's B leaves for W, per unit kind."""

    block: int
    head: int

    def times(self, microbatch: int) -> "DeferredOperands":
        return DeferredOperands(microbatch * self.block, microbatch * self.head)


class _PartSink:
    """A weight-gradient sink that only names its weight's part: the trace's W never runs."""

    fuses = False

    def __init__(self, part: str):
        self.part = part


@lru_cache(maxsize=256)
def sequence_deferred(key: ActivationKey) -> DeferredOperands:
    with fake_world.started():
        model, tp, tokens = traced_model(key)
        for part in PARTS:  # as FSDP gives every parameter view a sink
            for p in model.get_submodule(part).parameters():
                weight_grads.set_sink(p, _PartSink(part))
        with weight_grads.deferring(), FusedAttention():
            loss = vocab_parallel_cross_entropy(model(tokens), tokens, tp, key.model.valid_vocab_size).sum()
            # The engine itself: Tensor.backward would run inside the mode's handler, where the mode is off,
            # and a checkpoint's recompute would take the meta device's math attention.
            Variable._execution_engine.run_backward((loss,), (torch.ones_like(loss),), False, False, (), True, True)
            held = _held_bytes(weight_grads.take())
    # A tied head's GEMM reads the embedding's weight: its sink is the embedding's (whose lookup defers none).
    return DeferredOperands(block=held["layers.1"], head=held["head"] + held["tok_embeddings"])


def _held_bytes(work: list) -> dict[str, int]:
    """Per part, the bytes of the storages its deferred GEMMs hold."""
    held: dict[str, list[torch.Tensor]] = {part: [] for part in PARTS}
    for gemm in work:
        objects = list(captured(gemm))
        part = next(o.part for o in objects if isinstance(o, _PartSink))
        held[part] += [o for o in objects if isinstance(o, torch.Tensor)]
    return {part: storage_bytes(tensors) for part, tensors in held.items()}


def chunk_deferred(key: ActivationKey, microbatch: int) -> DeferredOperands:
    return sequence_deferred(key).times(microbatch)
