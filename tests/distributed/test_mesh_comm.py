"""The device mesh puts ranks where Megatron does, and the comm ledger counts exactly what ran."""

import pytest
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
    _check_gloo_lowerings(rank, mesh.group("dp"))


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


def _check_gloo_lowerings(rank: int, group: dist.ProcessGroup) -> None:
    """On gloo, an async all-gather runs as broadcasts and a reduce-scatter whose input the caller gives
    up as an in-place all-reduce: both must give torch's collective's result to the bit, and count once."""
    torch.manual_seed(rank)
    for dtype in (torch.float32, torch.bfloat16, torch.uint8):
        shard = torch.randint(0, 255, (6,), dtype=dtype) if dtype == torch.uint8 else torch.randn(6, dtype=dtype)
        expected, gathered = torch.empty(24, dtype=dtype), torch.empty(24, dtype=dtype)
        dist.all_gather_into_tensor(expected, shard, group=group)
        comm.LEDGER.reset()
        work = comm.all_gather_into_tensor(gathered, shard, group, async_op=True)
        assert isinstance(work, comm.ComposedWork)
        comm.wait(work, "all_gather", group)
        assert torch.equal(gathered, expected)
        assert comm.LEDGER.by_op() == {"all_gather": {"count": 1, "bytes": 24 * shard.element_size()}}
    for dtype in (torch.float32, torch.bfloat16):
        full = torch.randn(4 * 5, dtype=dtype) * 10 ** rank  # magnitudes where the order of the sum shows
        expected, out = torch.empty(5, dtype=dtype), torch.empty(5, dtype=dtype)
        dist.reduce_scatter_tensor(expected, full.clone(), group=group)
        comm.LEDGER.reset()
        for async_op in (True, False):
            out.fill_(float("nan"))
            work = comm.reduce_scatter_tensor(out, full.clone(), group, async_op=async_op, consume_input=True)
            if async_op:
                assert isinstance(work, comm.ComposedWork)
                comm.wait(work, "reduce_scatter", group)
            assert torch.equal(out, expected)
        assert comm.LEDGER.by_op() == {"reduce_scatter": {"count": 2, "bytes": 2 * 20 * full.element_size()}}
    shard = torch.randn(3, 2)  # not flat: rows of its own on every rank
    expected, gathered = torch.empty(12, 2), torch.empty(12, 2)
    dist.all_gather_into_tensor(expected, shard, group=group)
    comm.wait(comm.all_gather_into_tensor(gathered, shard, group, async_op=True), "all_gather", group)
    assert torch.equal(gathered, expected)
    with pytest.raises(ValueError, match=r"all_gather on group dp: \(22,\) torch.float32 is not 4 x \(6,\)"):
        comm.all_gather_into_tensor(torch.empty(22), torch.zeros(6), group, async_op=True)
    with pytest.raises(ValueError, match="reduce_scatter on group dp"):
        comm.reduce_scatter_tensor(torch.empty(5), torch.zeros(20, dtype=torch.bfloat16), group, consume_input=True)


def test_mesh_layouts_and_ledger():
    run_ranks(4, _check_layouts)
