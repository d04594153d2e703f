"""grad_reduce=per_microbatch against the default per-step reduction: the same training (1e-6), M
reduce-scatters per unit per step, and no unsharded gradient held across microbatches (memory sampled
during the backward); reductions overlapping the backward, holding only their reduce_dtype copy."""

import time
import weakref

import torch

from parallel import comm
from parallel.fsdp import FSDPConfig, hooks
from parallel.mesh import ParallelDims, ParallelMesh
from tests.distributed.fsdp_cases import UNITS, assert_params_close, full_params, reference_params, train_fsdp
from tests.distributed.spawn import run_ranks

STEPS, M = 2, 4


def _train(mesh: ParallelMesh, grad_reduce: str):
    """Train; returns (root, losses, last step's ledger, peak unit-held gradient bytes sampled at every
    unit's backward start, peak bytes of reductions in flight)."""
    peaks, ledgers = {"held": 0, "in_flight": 0}, []

    def sample_during_backward(root) -> None:
        prefetch = root.prefetch_previous

        def sampling_prefetch(unit):
            peaks["held"] = max(peaks["held"], sum(u.memory_bytes()["gradients"] for u in root.units))
            peaks["in_flight"] = max(peaks["in_flight"], root.reductions.bytes_in_flight)
            prefetch(unit)

        root.prefetch_previous = sampling_prefetch

    cfg = FSDPConfig(reshard_after_forward=True, grad_reduce=grad_reduce)
    root, losses = train_fsdp(cfg, mesh.group("dp_shard_cp"), mesh.group("dp_replicate"), mesh.dp_rank, mesh.dims.dp,
                              M, STEPS, on_step=lambda step, root: ledgers.append(comm.LEDGER.by_group()),
                              on_root=sample_during_backward)
    return root, losses, ledgers[-1], peaks


def _check(rank: int, world: int) -> None:
    reference = reference_params(STEPS)
    for mesh in (ParallelMesh(ParallelDims.from_sizes(world), "cpu"),
                 ParallelMesh(ParallelDims.from_sizes(world, dp_replicate=2), "cpu")):
        label = f"dp_replicate={mesh.dims.dp_replicate}"
        step_root, step_losses, step_ledger, step_peaks = _train(mesh, "last_microbatch")
        mb_root, mb_losses, mb_ledger, mb_peaks = _train(mesh, "per_microbatch")
        for got, want in zip(mb_losses, step_losses):
            assert abs(got - want) <= 1e-6 * abs(want), (label, mb_losses, step_losses)
        assert_params_close(full_params(mb_root), reference, 1e-6, f"per_microbatch {label}")
        shard_ops = comm.group_name(mesh.group("dp_shard_cp"))
        assert mb_ledger[shard_ops]["reduce_scatter"]["count"] == M * len(UNITS), mb_ledger
        assert step_ledger[shard_ops]["reduce_scatter"]["count"] == len(UNITS), step_ledger
        if mesh.dims.dp_replicate > 1:  # replicas are summed once per step in both modes
            replica = comm.group_name(mesh.group("dp_replicate"))
            assert mb_ledger[replica]["all_reduce"]["count"] == len(UNITS), mb_ledger
        unsharded = sum(u.spec.padded * 4 for u in mb_root.units)
        shard_sized = sum(u.spec.shard_size * 4 for u in mb_root.units)
        # The default keeps every unit's fp32 unsharded accumulator from microbatch 0 to M-1; per
        # microbatch keeps shard-sized sums only (plus at most two reductions in flight, transient).
        assert step_peaks["held"] >= unsharded, (step_peaks, unsharded)
        assert mb_peaks["held"] <= shard_sized, (mb_peaks, shard_sized)
        assert mb_peaks["in_flight"] <= 2 * max(u.spec.padded * 4 for u in mb_root.units), mb_peaks
        if rank == 0:
            print(f"{label}: gradient bytes held during backward: last_microbatch {step_peaks['held']}, per_microbatch "
                  f"{mb_peaks['held']} (+ at most {mb_peaks['in_flight']} in flight); unsharded fp32 {unsharded}")


class _SlowWork:
    """A reduce-scatter that takes at least DELAY_S to complete: its wait sleeps first."""

    def __init__(self, work, events: list):
        self.work, self.events = work, events

    def wait(self, *args) -> bool:
        time.sleep(DELAY_S)
        done = self.work.wait(*args)
        self.events.append(("reduce_scatter done", time.perf_counter()))
        return done


DELAY_S = 0.3


def _timeline(mesh: ParallelMesh, in_flight: int) -> list[tuple[str, float]]:
    """Events of one step's last microbatch: reduce-scatters issued and completed, unit backwards begun."""
    events: list[tuple[str, float]] = []
    reduce_scatter = comm.reduce_scatter_tensor

    def slow_reduce_scatter(*args, **kwargs):
        events.append(("reduce_scatter issued", time.perf_counter()))
        return _SlowWork(reduce_scatter(*args, **kwargs), events)

    def record_backward_starts(root) -> None:
        prefetch = root.prefetch_previous

        def recording_prefetch(unit):
            events.append(("unit backward begins", time.perf_counter()))
            prefetch(unit)

        root.prefetch_previous = recording_prefetch

    comm.reduce_scatter_tensor = slow_reduce_scatter
    try:
        train_fsdp(FSDPConfig(reductions_in_flight=in_flight), mesh.group("dp_shard_cp"), None, mesh.dp_rank,
                   mesh.dims.dp, 1, 1, on_root=record_backward_starts)
    finally:
        comm.reduce_scatter_tensor = reduce_scatter
    return events


def _fp32_gradients_alive_in_flight(mesh: ParallelMesh) -> list[int]:
    """reduce_dtype=bf16, two reductions in flight: at each unit's backward start, how many of the fp32
    gradients handed to reductions are still alive."""
    handed, alive = [], []
    take = hooks.unsharded_grad

    def tracked(unit):
        flat = take(unit)
        handed.append(weakref.ref(flat))
        return flat

    def record_backward_starts(root) -> None:
        prefetch = root.prefetch_previous

        def recording_prefetch(unit):
            alive.append(sum(ref() is not None for ref in handed))
            prefetch(unit)

        root.prefetch_previous = recording_prefetch

    hooks.unsharded_grad = tracked
    try:
        train_fsdp(FSDPConfig(reduce_dtype=torch.bfloat16, reductions_in_flight=2), mesh.group("dp_shard_cp"), None,
                   mesh.dp_rank, mesh.dims.dp, 1, 1, on_root=record_backward_starts)
    finally:
        hooks.unsharded_grad = take
    assert len(handed) == len(UNITS), handed
    return alive


def _check_overlap(rank: int, world: int) -> None:
    mesh = ParallelMesh(ParallelDims.from_sizes(world), "cpu")
    # A reduction in flight holds its bf16 cast only, not the fp32 gradient it was made from.
    alive = _fp32_gradients_alive_in_flight(mesh)
    assert alive and not any(alive), alive
    for in_flight in (2, 0):
        events = _timeline(mesh, in_flight)
        first_issue = next(i for i, (name, _) in enumerate(events) if name == "reduce_scatter issued")
        following = [name for name, _ in events[first_issue + 1 :]]
        next_backward = following.index("unit backward begins")
        first_done = following.index("reduce_scatter done")
        if in_flight:  # the next unit's backward starts while the first reduce-scatter is still running
            assert next_backward < first_done, events
        else:  # synchronous: it waits for it
            assert first_done < next_backward, events


def test_per_microbatch_reduction_matches_and_holds_only_shards():
    run_ranks(4, _check)


def test_reduce_scatters_overlap_the_next_units_backward():
    run_ranks(2, _check_overlap)
