"""In-tree FSDP against a single-process reference: numerics, exact collective counts, concats, bytes."""

from parallel import comm
from parallel.fsdp import FSDPConfig
from parallel.mesh import ParallelDims, ParallelMesh
from tests.distributed.fsdp_cases import UNITS, assert_params_close, full_params, make_model, reference_params, train_fsdp
from tests.distributed.spawn import run_ranks

STEPS = 3


def _layouts(world: int):
    """(label, mesh): dp_shard=4; dp_shard=2 (two independent copies, one per pp slot); HSDP 2x2."""
    yield "shard4", ParallelMesh(ParallelDims.from_sizes(world), "cpu")
    yield "shard2", ParallelMesh(ParallelDims.from_sizes(world, pipeline_parallel_size=2), "cpu")
    yield "hsdp2x2", ParallelMesh(ParallelDims.from_sizes(world, dp_replicate=2), "cpu")


def _check_numerics_and_counts(rank: int, world: int) -> None:
    reference = reference_params(STEPS)
    initial = {n: p.detach() for n, p in make_model().named_parameters()}
    moved = min(((reference[n] - p).norm() / p.norm()).item() for n, p in initial.items())
    assert moved > 1e-5, f"parameters barely moved ({moved:.2g}): the comparison would prove nothing"
    for label, mesh in _layouts(world):
        shard, replicate = mesh.group("dp_shard_cp"), mesh.group("dp_replicate")
        for reshard in (False, True):
            for m in (1, 4):
                cfg = FSDPConfig(reshard_after_forward=reshard, optimize_backward_concat=True)
                counts = []
                root, _ = train_fsdp(cfg, shard, replicate, mesh.dp_rank, mesh.dims.dp, m, STEPS,
                                     on_step=lambda step, root: counts.append(comm.LEDGER.by_group()))
                assert_params_close(full_params(root), reference, 1e-6, f"{label} reshard={reshard} M={m}")
                _assert_counts(counts[-1], mesh, reshard, m, label)


def _assert_counts(ledger: dict, mesh: ParallelMesh, reshard: bool, m: int, label: str) -> None:
    units = len(UNITS)
    shard_ops = ledger.get(comm.group_name(mesh.group("dp_shard_cp")), {})
    expected_gathers = units * (2 * m if reshard else 1)
    assert shard_ops["all_gather"]["count"] == expected_gathers, (label, reshard, m, shard_ops)
    assert shard_ops["reduce_scatter"]["count"] == units, (label, reshard, m, shard_ops)
    replica_ops = ledger.get(comm.group_name(mesh.group("dp_replicate")), {})
    if mesh.dims.dp_replicate > 1:
        assert replica_ops == {"all_reduce": {"count": units, "bytes": replica_ops["all_reduce"]["bytes"]}}
    else:
        assert replica_ops == {}


def test_fsdp_matches_single_process_and_counts_collectives():
    run_ranks(4, _check_numerics_and_counts)
