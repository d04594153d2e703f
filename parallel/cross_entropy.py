"""Next-token cross-entropy over (vocab-sharded) logits, in fp32, with one fp32 copy of the logits.

The logits are the largest activation of a Llama 3 step (8k tokens x 128k vocabulary: 4 GiB in fp32).
`F.cross_entropy` over fp32-cast logits holds the cast and a log-softmax in its forward and two fp32
gradients in its backward. Here the forward makes one fp32 copy and turns it into the softmax in place
(saved for backward), and the backward turns the saved softmax into the logits' gradient in place, as
Megatron's fused vocab-parallel cross-entropy does. Doing so bumps the softmax's version: a second
backward through the same graph (retain_graph) raises rather than reading a gradient as a softmax.

Under TP each rank holds a slice of the vocabulary: the max, the exp-sum and the target logit are
all-reduced (two all-reduces); the logits are never gathered.
"""

import torch
from torch.autograd.function import once_differentiable

from parallel import comm
from parallel.tensor_parallel import TPContext

IGNORE_INDEX = -100  # F.cross_entropy's default: such targets add zero loss and zero gradient


class _CrossEntropy(torch.autograd.Function):
    """Per-token loss. `group`: the TP group (None at tp=1); `vocab_start`: this rank's first column's
    id; `local_valid`: this rank's columns that are not padding. IGNORE_INDEX targets give 0; a target
    no rank owns (out of the vocabulary, or a padding id) gives NaN, which halts training."""

    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start, local_valid):
        # This function's own copy, contiguous (the backward views it by rows): every step below is in place.
        probs = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        # Padding columns get no probability, so no gradient; a rank of padding only has a max of -inf,
        # which the MAX all-reduce replaces by the other ranks'.
        probs[..., local_valid:] = float("-inf")
        logits_max = probs.max(dim=-1).values
        if group is not None:
            comm.all_reduce(logits_max, group, op=torch.distributed.ReduceOp.MAX)
        probs.sub_(logits_max.unsqueeze(-1))
        local = targets - vocab_start
        outside = (local < 0) | (local >= local_valid)  # a padding id is no token: no rank owns it
        local = local.masked_fill(outside, 0)
        target_logit = probs.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        probs.exp_()
        sums = torch.stack([probs.sum(dim=-1), target_logit, (~outside).to(probs.dtype)])  # one all-reduce
        if group is not None:
            comm.all_reduce(sums, group)
        sum_exp, target_logit, owners = sums[0], sums[1], sums[2]
        ignored = targets == IGNORE_INDEX
        ctx.save_for_backward(probs.div_(sum_exp.unsqueeze(-1)), local, outside, ignored)
        loss = (sum_exp.log() - target_logit).masked_fill(owners == 0, float("nan"))
        return loss.masked_fill(ignored, 0.0)

    @staticmethod
    @once_differentiable  # the gradient is made in place from saved data: no graph of its own
    def backward(ctx, grad_loss):
        grad, local, outside, ignored = ctx.saved_tensors  # the softmax, made the gradient in place
        rows = grad.view(-1, grad.shape[-1])
        # Indexed write with one index per row: deterministic on CUDA, unlike a 2-D scatter_add_.
        rows[torch.arange(rows.shape[0], device=rows.device), local.view(-1)] -= (~outside).view(-1).to(grad.dtype)
        return grad.mul_(grad_loss.masked_fill(ignored, 0.0).unsqueeze(-1)), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: TPContext,
                                 valid_vocab_size: int | None = None) -> torch.Tensor:
    """Per-token loss from [..., V/tp] logits and [...] global target ids, numerically stable. Columns
    from `valid_vocab_size` on (None: none) are a padded vocabulary's: never a target, masked out."""
    width = logits.shape[-1]
    valid = tp.size * width if valid_vocab_size is None else valid_vocab_size
    vocab_start = tp.rank * width
    local_valid = min(max(valid - vocab_start, 0), width)
    return _CrossEntropy.apply(logits, targets, tp.group if tp.size > 1 else None, vocab_start, local_valid)
