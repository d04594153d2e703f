"""A Llama-3-style decoder: embedding, N pre-norm blocks (GQA attention + SwiGLU), norm + head (tied to the
embedding or not).

Blocks live in a ModuleDict keyed by their global layer index, so a pipeline stage that keeps only
some blocks still has the same parameter names (and the same initialization) as the full model.
"""

from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from model.args import ModelArgs
from model.attention import Attention, Documents, RotaryEmbedding, attention_bias, block_causal_mask, block_gemm
from parallel.context_parallel import CPContext
from parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPContext, VocabParallelEmbedding, matmul

# The parameters whose rows (dim 0) are the vocabulary's: those past args.valid_vocab_size are padding.
VOCAB_PARAMETERS = ("tok_embeddings.weight", "head.output.weight")


# Under model.tie_embeddings: the one weight of the embedding and the output projection, and its copy in a
# chunk that holds the head but not the embedding (initialized, stored and imported as the weight itself).
TIED_WEIGHT = "tok_embeddings.weight"
TIED_COPY = "head.output.weight"


def weight_name(name: str, args: ModelArgs) -> str:
    """The weight a parameter holds: its own name, or for the tied head's copy, the embedding's."""
    return TIED_WEIGHT if args.tie_embeddings and name == TIED_COPY else name


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 whatever the compute dtype: bf16 variance loses too much.
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class FeedForward(nn.Module):
    """SwiGLU with one fused column-parallel gate/up projection and a row-parallel down projection."""

    def __init__(self, args: ModelArgs, tp: TPContext):
        super().__init__()
        self.tp = tp
        hidden_dim = args.ffn_hidden_dim
        self.w13 = ColumnParallelLinear(args.dim, (hidden_dim, hidden_dim), tp, block_gemm(args))  # gate, up
        self.w2 = RowParallelLinear(hidden_dim, args.dim, tp, block_gemm(args))  # down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w13.split(self.w13(self.tp.enter(x)))
        return self.w2(nn.functional.silu(gate) * up)


class TransformerBlock(nn.Module):
    """Pre-norm block; under sequence parallelism the norms and residual adds see 1/tp of the tokens."""

    def __init__(self, layer_id: int, args: ModelArgs, tp: TPContext, cp: CPContext | None = None):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.attention = Attention(args, tp, cp or CPContext())
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.feed_forward = FeedForward(args, tp)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                documents: Documents | None = None) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, documents)
        return h + self.feed_forward(self.ffn_norm(h))


class OutputHead(nn.Module):
    """Final norm + vocabulary projection: one module so it can be one FSDP unit. The projection is
    column-parallel over the vocabulary: logits stay vocab-sharded (never gathered).

    Under model.tie_embeddings the projection is the embedding's weight, which is split over the
    vocabulary too, so the TP shards coincide. A chunk that also holds the embedding passes its weight in
    (`reads_embedding`: the head has no projection of its own); a chunk without it (a later pipeline
    stage) holds a copy (TIED_COPY), kept equal to it by the trainer (parallel/fsdp/tied.py)."""

    def __init__(self, args: ModelArgs, tp: TPContext, reads_embedding: bool = False):
        super().__init__()
        self.tp = tp
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = None if reads_embedding else ColumnParallelLinear(args.dim, args.vocab_size, tp)

    def forward(self, h: torch.Tensor, embedding: torch.Tensor | None = None) -> torch.Tensor:
        x = self.tp.enter(self.norm(h))
        return matmul(x, embedding, None) if self.output is None else self.output(x)


BlockFactory = Callable[[int, ModelArgs, TPContext, CPContext], nn.Module]


class Transformer(nn.Module):
    """The whole model, or one pipeline chunk of it: the blocks `layers` (global indices), with the
    embedding only on the chunk that starts the model and the head only on the one that ends it. Under
    model.tie_embeddings a chunk with both has one parameter for the two (the head reads the embedding's)."""

    def __init__(
        self, args: ModelArgs, tp: TPContext | None = None, layers: range | None = None,
        embedding: bool = True, head: bool = True, cp: CPContext | None = None, blocks: BlockFactory | None = None,
    ):
        """`blocks` builds the transformer blocks (default: TransformerBlock); a factory with a `region()`
        runs them inside it (TransformerEngine's autocast, model/te.py)."""
        super().__init__()
        self.args = args
        self.tp, self.cp = tp or TPContext(), cp or CPContext()
        layers = range(args.n_layers) if layers is None else layers
        self.tok_embeddings = VocabParallelEmbedding(args.vocab_size, args.dim, self.tp) if embedding else None
        self.rope = RotaryEmbedding(args.head_dim, args.rope_theta, args.rope_scaling)
        make_block = blocks or TransformerBlock
        self.layers = nn.ModuleDict({str(i): make_block(i, args, self.tp, self.cp) for i in layers})
        self.block_region = getattr(blocks, "region", nullcontext)
        self.head = OutputHead(args, self.tp, reads_embedding=embedding and args.tie_embeddings) if head else None

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [batch, seq] (or, past the first chunk, hidden states [batch, seq or seq/tp under SP,
        dim]) -> logits [batch, seq, vocab/tp] (or hidden states, before the last chunk). Under context
        parallelism seq is this CP rank's share and positions default to its tokens' global ones.
        `document_ids` [batch, seq] (block_causal; every chunk gets them; under CP the whole sequence's):
        attention stays inside each document."""
        h = x if self.tok_embeddings is None else self.tok_embeddings(x)
        if positions is None:
            seq = x.shape[1] * (self.tp.size if self.tok_embeddings is None and self.tp.sequence_parallel else 1)
            positions = self.cp.positions(seq, x.device)
        cos, sin = self.rope(positions, h.dtype)
        documents = None if document_ids is None else self._documents(document_ids.to(h.device), h.dtype)
        with self.block_region():
            for layer in self.layers.values():
                h = layer(h, cos, sin, documents)
        return h if self.head is None else self.logits(h)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head on the last block's output (a tied head reads the embedding's weight held here)."""
        return self.head(h, self.tok_embeddings.weight if self.head.output is None else None)

    def _documents(self, ids: torch.Tensor, dtype: torch.dtype) -> Documents:
        """The microbatch's documents, their mask and its bias made once for every layer (`dtype`: the blocks';
        the math formula takes the bool mask, so no bias is made for it)."""
        if self.cp.size > 1:
            return Documents(ids, None)
        mask = block_causal_mask(ids)
        return Documents(ids, mask, None if self.args.efficient_attn == "math" else attention_bias(mask, dtype))
