"""A step's sequence indices for this data-parallel rank, as (inputs, targets) microbatches."""

import numpy as np
import torch

from parallel.errors import ConfigError
from trainer.data.blend import BlendedTokens
from trainer.data.sampler import GlobalBatchSampler, HeldOutSampler, per_rank_batch_size
from trainer.data.shards import PackedTokens


class BatchLoader:
    """Turns a step's sequence indices for this data-parallel rank into (inputs, targets) microbatches."""

    def __init__(
        self,
        tokens: BlendedTokens | PackedTokens,
        sampler: GlobalBatchSampler | HeldOutSampler,
        seq_len: int,
        dp_rank: int,
        dp_size: int,
        microbatch_size: int,
        document_start_id: int | None = None,
        document_end_id: int | None = None,
    ) -> None:
        """`document_start_id` / `document_end_id`: the tokens the packer puts around each document (the
        tokenizer's bos and eos), for document_ids."""
        self.per_rank_batch = per_rank_batch_size(sampler.global_batch_size, dp_size)
        if microbatch_size < 1 or self.per_rank_batch % microbatch_size:
            raise ConfigError(
                f"microbatch_size={microbatch_size} must divide batch_size={self.per_rank_batch}"
            )
        self.tokens, self.sampler, self.seq_len = tokens, sampler, seq_len
        self.dp_rank, self.dp_size, self.microbatch_size = dp_rank, dp_size, microbatch_size
        self.document_start_id, self.document_end_id = document_start_id, document_end_id

    def batch(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's microbatches of step `step` (0-based): [microbatch_size, seq_len] int64 each."""
        indices = self.sampler.rank_indices(step, self.dp_rank, self.dp_size)
        windows = torch.from_numpy(np.stack([self.tokens.sequence(int(i), self.seq_len) for i in indices]))
        size = self.microbatch_size
        return [
            (windows[i : i + size, :-1].contiguous(), windows[i : i + size, 1:].contiguous())
            for i in range(0, len(indices), size)
        ]

    def document_ids(self, inputs: torch.Tensor) -> torch.Tensor:
        """[b, s] index of each input token's document within its sequence; a window that opens inside a
        document holds its tail as 0. The packer writes `bos doc eos` runs back to back, so a document starts
        at a bos right after an eos (or at a window's first token, if bos): a bos inside a document (Megatron
        data preprocessed with --split-sentences by a tokenizer that adds one per sentence) starts none, and
        neither does the eos that closes a document where the tokenizer's bos and eos are one token."""
        if self.document_start_id is None or self.document_end_id is None:
            raise ValueError("this loader was built without the document tokens: it cannot tell documents apart")
        return document_starts(inputs, self.document_start_id, self.document_end_id).cumsum(dim=1)


def document_starts(tokens: torch.Tensor, bos_id: int, eos_id: int) -> torch.Tensor:
    """[b, s] bool: where a packed document starts (BatchLoader.document_ids' rule)."""
    after_end = torch.ones_like(tokens, dtype=torch.bool)
    after_end[:, 1:] = tokens[:, :-1] == eos_id
    return (tokens == bos_id) & after_end
