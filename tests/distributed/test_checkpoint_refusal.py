"""A checkpoint one rank refuses is refused by every rank, each with the same line, and none goes on
into DCP's collectives to wait there for the others: each rank checks its own tensors (pipeline stages
hold different ones), here a weight only rank 1 holds, saved in another dtype."""

from pathlib import Path

import pytest
import torch

from parallel import comm
from tests.distributed.spawn import run_ranks
from trainer.checkpoint.files import CheckpointError, load_checkpoint, save_checkpoint


def _check(rank: int, world: int, folder: str) -> None:
    dtype = torch.float64 if rank == 1 else torch.float32
    saved = {"model": {f"w{rank}": torch.ones(2, dtype=dtype)}, "trainer": {"step": torch.tensor(3)}}
    path = save_checkpoint(Path(folder), 3, saved, comm.world(), rank=rank, extra_files={})
    target = {"model": {f"w{rank}": torch.zeros(2)}, "trainer": {"step": torch.tensor(0)}}
    with pytest.raises(CheckpointError, match="model.w1 was saved as torch.float64 and this run holds it as "
                                              "torch.float32"):
        load_checkpoint(path, target, comm.world())
    assert not target["model"][f"w{rank}"].any() and int(target["trainer"]["step"]) == 0  # nothing loaded


def test_a_refusal_of_one_rank_is_every_ranks(tmp_path):
    run_ranks(2, _check, str(tmp_path))
