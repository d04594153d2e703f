"""The device mesh puts ranks where Megatron does, and the comm ledger counts exactly what ran."""

import torch
import torch.distributed as dist

from parallel import comm
from parallel.mesh import ParallelDims, ParallelMesh
from tests.distributed.spawn import run_ranks


def _ranks(mesh: ParallelMesh, name: str) -> list[int]:
    return dist.get_process_group_ranks(mesh.group(name))


def _check_layouts(rank: int, world: int) -> None:
    # tp fastest, then cp, dp_shard, dp_replicate, pp.
    mesh = ParallelMesh(ParallelDims.from_sizes(world, model_parallel_size=2), "cpu")
    assert _ranks(mesh, "tp") == [rank - rank % 2, rank - rank % 2 + 1]
    assert _ranks(mesh, "dp") == _ranks(mesh, "dp_shard") == [rank % 2, rank % 2 + 2]
    assert mesh.dp_rank == rank // 2
    mesh = ParallelMesh(ParallelDims.from_sizes(world, pipeline_parallel_size=2, context_parallel_size=2), "cpu")
    assert _ranks(mesh, "cp") == [rank - rank % 2, rank - rank % 2 + 1]
    assert _ranks(mesh, "pp") == [rank % 2, rank % 2 + 2]
    assert _ranks(mesh, "dp_shard_cp") == _ranks(mesh, "cp")
    mesh = ParallelMesh(ParallelDims.from_sizes(world, dp_replicate=2), "cpu")
    assert _ranks(mesh, "dp_shard") == [rank - rank % 2, rank - rank % 2 + 1]
    assert _ranks(mesh, "dp_replicate") == [rank % 2, rank % 2 + 2]
    assert _ranks(mesh, "dp") == [0, 1, 2, 3]
    _check_ledger(rank, mesh)


def _check_ledger(rank: int, mesh: ParallelMesh) -> None:
    comm.LEDGER.reset()
    x = torch.full((3,), float(rank))
    comm.all_reduce(x, mesh.group("dp_shard"))
    assert x.tolist() == [float(2 * (rank - rank % 2) + 1)] * 3
    gathered = torch.empty(4 * 2)
    comm.all_gather_into_tensor(gathered, torch.full((2,), float(rank)), mesh.group("dp"))
    assert gathered.tolist() == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    out = torch.empty(2, dtype=torch.bfloat16)
    work = comm.reduce_scatter_tensor(out, torch.ones(4, dtype=torch.bfloat16), mesh.group("dp_replicate"), async_op=True)
    work.wait()
    assert out.tolist() == [2.0, 2.0]
    assert comm.LEDGER.by_group() == {
        "dp_shard": {"all_reduce": {"count": 1, "bytes": 12}},
        "dp": {"all_gather": {"count": 1, "bytes": 32}},
        "dp_replicate": {"reduce_scatter": {"count": 1, "bytes": 8}},
    }
    assert comm.LEDGER.by_op()["all_gather"] == {"count": 1, "bytes": 32}


def test_mesh_layouts_and_ledger():
    run_ranks(4, _check_layouts)
