"""How a sequence is split over the C ranks of context parallelism, and which chunks then see which.

A sequence splits into 2C chunks; CP rank r holds chunks r and 2C-1-r ("head-tail"), so every rank has
the same causal work (a chunk early in the sequence sees few keys, its partner late in the sequence
many). Tokens, targets and rotary positions are sharded once, by the data path; rotary embeddings use
the tokens' global positions. Attention works chunk pair by chunk pair: a key chunk before the query
chunk is seen whole, the same chunk as a lower triangle, a later one not at all (skipped).
"""

from dataclasses import dataclass

import torch
from torch.distributed import ProcessGroup

from parallel import comm


@dataclass
class CPContext:
    group: ProcessGroup | None = None
    comm_mode: str = "all_gather"  # all_gather | ring
    kernel: str = "sdpa"  # each chunk pair's attention kernel: model.efficient_attn (kernels.py)
    unmasked_pairs: int = 0  # (query, key) pairs this rank's attention computed: the load balance

    @property
    def size(self) -> int:
        return comm.size_of(self.group)

    @property
    def rank(self) -> int:
        return comm.rank_in(self.group)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's chunks r and 2C-1-r of a full sequence dimension."""
        if self.size == 1:
            return x
        self._check_length(x.shape[dim], 2 * self.size)
        chunks = x.chunk(2 * self.size, dim)
        return torch.cat([chunks[self.rank], chunks[2 * self.size - 1 - self.rank]], dim).contiguous()

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """Global positions of the `local_len` tokens this CP rank holds."""
        if self.size > 1:
            self._check_length(local_len, 2)
        half = local_len // 2
        ranges = [torch.arange(c * half, (c + 1) * half, device=device) for c in (self.rank, 2 * self.size - 1 - self.rank)]
        return torch.cat(ranges) if self.size > 1 else torch.arange(local_len, device=device)

    @staticmethod
    def _check_length(length: int, chunks: int) -> None:
        # Uneven chunks would put tokens at other positions than the rotary positions and the
        # chunk-level causality assume (validate refuses such a seq_len; this guards direct callers).
        if length % chunks:
            raise ValueError(f"context parallelism: a sequence dimension of {length} does not split into {chunks} "
                             f"equal chunks")


def visible_pairs(rank: int, holder: int, size: int) -> list[tuple[int, int, int, int]]:
    """(query half, key half, query chunk, key chunk) of this rank's queries and `holder`'s block that
    causality does not hide: halves are chunks (rank, 2C-1-rank) of the sequence; a pair of the same chunk
    is a lower triangle, a key chunk before the query chunk is seen whole, one after it not at all."""
    q_chunks, k_chunks = (rank, 2 * size - 1 - rank), (holder, 2 * size - 1 - holder)
    return [(qa, kb, q_chunk, k_chunk) for qa, q_chunk in enumerate(q_chunks)
            for kb, k_chunk in enumerate(k_chunks) if k_chunk <= q_chunk]


def chunk_pair_mask(document_ids: torch.Tensor | None, q_chunk: int, k_chunk: int, half: int) -> torch.Tensor | None:
    """block_causal: which (query, key) pairs of two chunks share a document, causal within one chunk
    ([b, half, half] bool); None without documents. `document_ids` [b, s] are the whole sequence's."""
    if document_ids is None:
        return None
    queries = document_ids[:, q_chunk * half : (q_chunk + 1) * half]
    keys = document_ids[:, k_chunk * half : (k_chunk + 1) * half]
    allowed = queries[:, :, None] == keys[:, None, :]
    if q_chunk == k_chunk:
        allowed &= torch.ones(half, half, dtype=torch.bool, device=allowed.device).tril()
    return allowed
