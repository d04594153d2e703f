"""Batched point-to-point: one work per operation, whatever the backend returns, so that a caller
pairing works with operations waits on every receive."""

import pytest
import torch

from parallel import comm


class _CoalescedWork:
    """What NCCL returns for a whole batch: one work, done when every operation of the batch is."""

    def wait(self) -> bool:
        return True


@pytest.fixture
def coalescing_backend(world, monkeypatch):
    work = _CoalescedWork()
    monkeypatch.setattr(comm.dist, "batch_isend_irecv", lambda p2p: [work])
    return work


def test_a_coalesced_batch_gives_every_operation_its_work(coalescing_backend):
    ops = [(True, torch.zeros(2), 0), (False, torch.zeros(2), 0), (False, torch.zeros(3), 0)]
    works = comm.batch_isend_irecv(ops, comm.dist.group.WORLD, "test")
    assert works == [coalescing_backend] * 3


def _runtime(schedule: str, pp: int, vpp: int, m: int, rank: int, chunk=None):
    from parallel.pipeline.runtime import PipelineRuntime, PlainChunkRoot
    from parallel.pipeline.schedule import schedule_actions

    chunks = [chunk or torch.nn.Linear(4, 4) for _ in range(vpp)]
    return PipelineRuntime(schedule_actions(schedule, pp, vpp, m, rank), pp, chunks, [PlainChunkRoot()] * vpp,
                           comm.dist.group.WORLD, (2, 4), torch.float32, torch.device("cpu"))


def _held(runtime, sent: list, freed: list) -> tuple[int, int, int, int]:
    """Run a step; (the runtime's peak of outgoing tensors and bytes, the most sent tensors alive at once,
    the most receive buffers posted ahead while the rank computes). `freed` gets, per forward whose
    output is sent, whether that output's storage is empty."""
    alive, ahead = [0], [0]
    post, forward, exchange = comm.batch_isend_irecv, runtime._forward, runtime._exchange

    def posting(ops, group, label=""):
        works = post(ops, group, label)
        alive[0] = max(alive[0], sum(ref() is not None for ref in sent))
        return works

    def forwarding(a, *args):
        forward(a, *args)
        if a.chunk * runtime.pp + a.rank < runtime.num_stages - 1:
            freed.append(runtime._saved[(a.chunk, a.microbatch)][1].untyped_storage().nbytes() == 0)

    def exchanging(batch, following):
        exchange(batch, following)
        ahead[0] = max(ahead[0], len(runtime._receiving))

    comm.batch_isend_irecv, runtime._forward, runtime._exchange = posting, forwarding, exchanging
    try:
        runtime.run_step(lambda mb: torch.ones(2, 4), lambda y, mb: y.sum())
    finally:
        comm.batch_isend_irecv = post
    assert all(ref() is None for ref in sent)  # every sent tensor is released by the step's end
    assert not runtime._receiving  # every receive posted ahead was waited
    return runtime.peak_p2p_tensors, runtime.peak_p2p_bytes, alive[0], ahead[0]


def _widest_receive(schedule: str, pp: int, vpp: int, m: int, rank: int) -> int:
    from parallel.pipeline.schedule import batched, schedule_actions

    steps = batched(schedule_actions(schedule, pp, vpp, m, rank))
    return max(sum(a.op.startswith("RECV") for a in step) for step in steps)


def test_the_p2p_memory_of_a_rank_does_not_grow_with_the_microbatch_count(world, monkeypatch):
    """Sends are waited at the rank's next batch with the same peer and their tensors dropped, a stage
    output's data is freed once handed to its send: M=16 holds the outgoing tensors M=4 holds; receives
    are posted one batch ahead, as many buffers as a batch receives, which stops growing with M."""
    import weakref

    sent: list = []
    freed: list = []

    def batch(p2p):
        sent.extend(weakref.ref(op.tensor) for op in p2p if op.op is comm.dist.isend)
        return [_CoalescedWork()]

    monkeypatch.setattr(comm.dist, "batch_isend_irecv", batch)
    for schedule, pp, vpp in (("1f1b", 2, 1), ("1f1b", 4, 1), ("interleaved_1f1b", 2, 2), ("interleaved_1f1b", 4, 2)):
        for rank in range(pp):
            held = [_held(_runtime(schedule, pp, vpp, m, rank), sent, freed) for m in (4, 16)]
            assert held[0][:3] == held[1][:3], (schedule, pp, vpp, rank, held)
            assert held[0][0] <= 2 and held[0][1] == held[0][0] * 2 * 4 * 4, (schedule, pp, vpp, rank, held)
            # Buffers ahead: at most the largest batch's receives, which stops growing with M.
            widest = [_widest_receive(schedule, pp, vpp, m, rank) for m in (4, 16, 64)]
            assert widest[1] == widest[2] <= 3 and all(1 <= h[3] <= w for h, w in zip(held, widest)), (
                schedule, pp, vpp, rank, held, widest)
    assert freed and all(freed)  # a sent output keeps its autograd node, not its data


def test_an_outgoing_tensor_of_the_wrong_shape_or_dtype_names_its_stage_and_microbatch(world):
    """The peer receives into a buffer of the runtime's fixed shape and dtype; NCCL would hang or write
    past it, so the sender refuses before posting anything."""
    runtime = _runtime("1f1b", 2, 1, 2, 0, chunk=torch.nn.Linear(4, 3))
    with pytest.raises(RuntimeError, match=r"stage 0 \(rank 0, chunk 0\) microbatch 0: activation to send is "
                                           r"\(2, 3\) torch.float32, stage 1 receives \(2, 4\) torch.float32"):
        runtime.run_step(lambda mb: torch.ones(2, 4), lambda y, mb: y.sum())
    from parallel.pipeline.schedule import BACKWARD, FORWARD, Action

    runtime = _runtime("1f1b", 2, 1, 2, 1, chunk=torch.nn.Linear(4, 4).double())
    runtime._inbox[(FORWARD, 1, 1)] = torch.ones(2, 4, dtype=torch.float64)  # as if received in float64
    runtime._forward(Action(1, FORWARD, 0, 1), None, lambda y, mb: y.sum(), lambda mb: {}, True)
    with pytest.raises(RuntimeError, match=r"stage 1 \(rank 1, chunk 0\) microbatch 1: input gradient to send "
                                           r"is \(2, 4\) torch.float64"):
        runtime._backward(Action(1, BACKWARD, 0, 1))
