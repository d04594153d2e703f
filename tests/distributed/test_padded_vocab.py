"""The trainer's own step (StepRunner on synthetic batches) with a padded vocabulary trains as the unpadded
model: the same losses (within 1e-6) and gradient norms, and the padding rows of the embedding and the
head stay exactly zero under AdamW with weight decay. On tp=1 x dp=2 (FSDP shards cut through the
padding) and on tp=2, whose second rank holds padding only."""

import torch
import torch.distributed as dist

from model.transformer import VOCAB_PARAMETERS
from parallel import comm
from parallel.fsdp.flat_param import unflatten
from tests.distributed import pipeline_cases as cases
from tests.distributed.spawn import run_ranks
from trainer.config.vocab import with_tokenizer_vocabulary
from trainer.step import StepRunner

IDS = cases.MODEL["vocab_size"]  # the synthetic batches' token ids, 0 .. 63: the "tokenizer's" size
OPTIM = {"lr": 1e-2, "warmup_steps": 1, "weight_decay": 0.1}


def _vocabulary_weights(trainer: StepRunner) -> dict[str, torch.Tensor]:
    """The full embedding and head, gathered over FSDP shards and TP ranks."""
    out = {}
    for root in trainer.roots:
        for unit in root.units:
            flat = torch.empty(unit.spec.padded)
            comm.all_gather_into_tensor(flat, unit.flat_param.detach(), unit.shard_group)
            for name, local in unflatten(flat, unit.spec).items():
                if f"{unit.name}.{name}" in VOCAB_PARAMETERS:
                    slices = [torch.empty_like(local) for _ in range(unit.tp.size)]
                    dist.all_gather(slices, local.contiguous(), group=unit.tp.group)
                    out[f"{unit.name}.{name}"] = torch.cat(slices)
    return out


def _padded_trains_as_unpadded(rank: int, world: int) -> None:
    for tp, divisible_by, rows in ((1, 48, 96), (2, 64, 128)):
        layout = {"model_parallel_size": tp, "batch_size": 2, "optim": OPTIM}
        unpadded = with_tokenizer_vocabulary(cases.config(**layout), IDS, "synthetic")
        padded = with_tokenizer_vocabulary(cases.config(make_vocab_size_divisible_by=divisible_by, **layout), IDS,
                                           "synthetic")
        assert (padded.model.vocab_size, padded.model.valid_vocab_size) == (rows, IDS)
        reference, want = cases.train(unpadded, world)
        trainer, got = cases.train(padded, world)
        for step, (a, b) in enumerate(zip(got, want), 1):
            assert abs(a.loss - b.loss) <= 1e-6 * b.loss, (tp, step, a.loss, b.loss)
            assert abs(a.grad_norm - b.grad_norm) <= 1e-6 * b.grad_norm, (tp, step, a.grad_norm, b.grad_norm)
        trained, expected = _vocabulary_weights(trainer), _vocabulary_weights(reference)
        for name, weight in trained.items():
            assert not weight[IDS:].any(), (tp, name)  # zero at init, and no update moved them
            assert torch.allclose(weight[:IDS], expected[name], rtol=1e-5, atol=1e-7), (tp, name)


def test_a_padded_vocabulary_trains_as_the_unpadded_one():
    run_ranks(2, _padded_trains_as_unpadded)
