"""Context parallelism: each of C ranks holds 1/C of every sequence, load-balanced for causal attention.

Attention is the one place where a token needs the others' data: a rank's queries must see the keys and
values of the whole sequence. The package splits that into one concept per module:

  sharding.py    which chunks of a sequence a rank holds (head-tail, for equal causal work), their
                 global positions, and which chunk pairs causality lets see each other (CPContext)
  lse.py         the attention core over one block of keys, returning its log-sum-exp, and the merge
                 of such partial results (forward and backward) that both exchanges share
  all_gather.py  K/V all-gathered over the CP group, dK/dV reduce-scattered back
  ring.py        K/V blocks rotated around the CP ring point to point, dK/dV rotated home

`context_parallel_attention` below picks the exchange (`context_parallel_comm`); both compute the same
attention. Communication goes through parallel/comm.py, as everywhere in parallel/.
"""

import torch

from parallel.context_parallel.all_gather import all_gather_attention
from parallel.context_parallel.lse import (
    attention_backward, attention_with_lse, math_attention_backward, math_attention_with_lse,
)
from parallel.context_parallel.ring import ring_attention
from parallel.context_parallel.sharding import CPContext
from parallel.regional_compile import eager_region


@eager_region
def context_parallel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPContext,
                               document_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence: [b, heads, s/C, d] -> same.
    `document_ids` [b, s] (block_causal; the whole sequence's, on every CP rank): a query sees only the
    keys of its own document."""
    if cp.comm_mode == "ring":
        return ring_attention(q, k, v, cp, document_ids)
    return all_gather_attention(q, k, v, cp, document_ids)


__all__ = [
    "CPContext", "attention_backward", "attention_with_lse", "context_parallel_attention", "math_attention_backward",
    "math_attention_with_lse",
]
