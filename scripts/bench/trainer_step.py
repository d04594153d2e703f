"""What benchmarks of the trainer's own step share: random token batches behind the loader interface,
and the command-line options (model, sequence length, rounds, --quick)."""

import argparse

import torch

from trainer.config.schema import TrainConfig


class RandomTokens:
    """Each rank its own `batch_size` random sequences per step, as microbatches of one sequence."""

    def __init__(self, cfg: TrainConfig, rank: int):
        self.cfg, self.rank = cfg, rank

    def batch(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        gen = torch.Generator().manual_seed(step * 100 + self.rank)
        tokens = torch.randint(0, self.cfg.model.vocab_size, (self.cfg.batch_size, self.cfg.seq_len + 1), generator=gen)
        return [(tokens[i : i + 1, :-1], tokens[i : i + 1, 1:]) for i in range(self.cfg.batch_size)]


def step_bench_options(description: str) -> argparse.Namespace:
    """--model (default small), --seq (256), --rounds (5); --quick: model=tiny, seq 64, 2 rounds."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="model=tiny, seq 64, 2 rounds")
    opts = parser.parse_args()
    if opts.quick:
        opts.model, opts.seq, opts.rounds = "tiny", 64, 2
    return opts
