"""Run a benchmark function on fresh local gloo ranks (one process each, one thread each)."""

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.mesh import shutdown_process_groups


def _entry(rank: int, world: int, store: str, fn: Callable, args: tuple, results: Any) -> None:
    torch.set_num_threads(1)
    # A file store: no TCP port to pick, so no race with other jobs for it.
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args)
        if rank == 0:
            results.put(result)
    finally:
        shutdown_process_groups()


def spawn(world: int, fn: Callable, *args: Any) -> Any:
    """fn(rank, world, *args) on `world` fresh gloo ranks; returns rank 0's (small, picklable) result."""
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited, so it is set before the children import torch
    results = mp.get_context("spawn").SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_entry, args=(world, f"{tmp}/store", fn, args, results), nprocs=world,
                           start_method="spawn")
    return results.get()
