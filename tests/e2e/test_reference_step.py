"""The whole training step against a reference that shares none of the trainer's step code: a plain
model, torch's mean cross-entropy over the global batch, torch's clip_grad_norm_ and AdamW, and the LR
schedule written from docs/config.md. Layout tests compare layouts with each other; a mistake every
layout shares (the loss divisor, clipping after the step, the LR one step off) only shows here."""

import json
import math

import torch
import torch.nn.functional as F

from model.init import init_weights
from model.transformer import Transformer
from tests.e2e.launch import DATA_CACHE, train_ok
from trainer.checkpoint.state import load_full_weights
from trainer.config.schema import from_dict
from trainer.data.loader import BatchLoader
from trainer.data.prepare import prepare_dataset
from trainer.data.sampler import GlobalBatchSampler, split_windows

STEPS, CLIP = 4, 0.5
RUN = ("model=tiny", "seq_len=64", "batch_size=2", "microbatch_size=1", f"steps={STEPS}", "log_all_steps=true",
       "optim.warmup_steps=2", "optim.decay_style=linear", f"optim.clip_grad_norm={CLIP}", "checkpoint.freq=100")


def documented_lr(step: int, cfg) -> float:
    """Linear warmup to lr over warmup_steps, then the decay from the end of warmup to the last step,
    down to lr * min_lr_ratio (docs/config.md)."""
    o = cfg.optim
    if step <= o.warmup_steps:
        return o.lr * step / o.warmup_steps
    progress = (step - o.warmup_steps) / (cfg.steps - o.warmup_steps)
    return o.lr * (1 - (1 - o.min_lr_ratio) * progress)


def reference_run(cfg, global_batch: int):
    """Per step (loss, grad norm before clipping, lr), and the final weights."""
    tokenizer, tokens = prepare_dataset(cfg.data.source, cfg.data.tokenizer, cfg.model.vocab_size, DATA_CACHE,
                                        True, lambda line: None)
    windows, _ = split_windows(tokens.num_tokens, cfg.seq_len, cfg.data.held_out_fraction)
    loader = BatchLoader(tokens, GlobalBatchSampler(windows, global_batch, cfg.seed), cfg.seq_len, 0, 1,
                         global_batch, tokenizer.bos_id)
    args = cfg.model
    model = Transformer(args)
    with torch.no_grad():
        init_weights(model, args, cfg.seed)
    o = cfg.optim
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                            weight_decay=o.weight_decay, foreach=False)
    steps = []
    for step in range(1, cfg.steps + 1):
        (inputs, targets), = loader.batch(step - 1)
        loss = F.cross_entropy(model(inputs).float().flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip_grad_norm).item()
        for group in opt.param_groups:
            group["lr"] = documented_lr(step, cfg)
        opt.step()
        steps.append((loss.item(), norm, documented_lr(step, cfg)))
    return steps, {name: p.detach() for name, p in model.named_parameters()}


def test_two_ranks_of_two_microbatches_step_like_the_reference(tmp_path):
    dump = tmp_path / "run"
    records = {r["step"]: r for r in train_ok(2, dump, *RUN) if "loss" in r}
    cfg = from_dict(json.loads((dump / "train_config.json").read_text()))
    initial = Transformer(cfg.model)
    with torch.no_grad():
        init_weights(initial, cfg.model, cfg.seed)
    expected, weights = reference_run(cfg, global_batch=4)
    for step, (loss, norm, lr) in enumerate(expected, start=1):
        got = records[step]
        assert math.isclose(got["loss"], loss, rel_tol=1e-5), (step, got["loss"], loss)
        assert math.isclose(got["grad_norm"], norm, rel_tol=1e-5), (step, got["grad_norm"], norm)
        assert math.isclose(got["lr"], lr, rel_tol=1e-12), (step, got["lr"], lr)
    assert any(norm > CLIP for _, norm, _ in expected), "clipping never acted: the test would not see it"
    saved = load_full_weights(dump / "checkpoints" / f"step_{STEPS}", cfg)
    for name, p in initial.named_parameters():
        update = (weights[name] - p.detach()).norm()
        assert (saved[name] - weights[name]).norm() <= 1e-3 * update, name
