"""Run a function on N gloo ranks in fresh processes (one process group per test, torchrun-free).

The processes fork from a server that imported torch once (multiprocessing's forkserver): started
with "spawn", each rank of each test imported torch again, seconds of CPU per rank on a 2-core CI
machine. The server only imports: no thread pool or process group exists in it before it forks.
"""

import os
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp

from parallel.mesh import shutdown_process_groups


def _entry(rank: int, world: int, store_file: str, fn, args, errors) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import torch

    torch.set_num_threads(1)
    # A file store: no TCP port to pick, so no race with other jobs grabbing the same port.
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
    except BaseException:
        errors.put(f"rank {rank}:\n{traceback.format_exc()}")
        raise
    finally:
        shutdown_process_groups()
    # The rank passed and its groups are destroyed: skip interpreter teardown, where a gloo thread that
    # outlived them can still abort the process ("terminate called without an active exception", seen
    # under CPU contention in about one suite run in four) and fail a test whose checks all passed.
    os._exit(0)


_CONTEXT = mp.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "parallel.mesh", "trainer.run"])


def run_ranks(world: int, fn, *args) -> None:
    """fn(rank, world, *args) on every rank; re-raises the first rank's failure with its traceback."""
    errors = _CONTEXT.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.start_processes(_entry, args=(world, f"{tmp}/store", fn, args, errors), nprocs=world,
                               start_method="forkserver")
        except Exception as e:
            detail = errors.get() if not errors.empty() else str(e)
            raise AssertionError(detail) from None
