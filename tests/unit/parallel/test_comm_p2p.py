"""Batched point-to-point: one work per operation, whatever the backend returns, so that a caller
pairing works with operations waits on every receive."""

import pytest
import torch

from parallel import comm


class _CoalescedWork:
    """What NCCL returns for a whole batch: one work, done when every operation of the batch is."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self) -> bool:
        self.waits += 1
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


def test_a_pipeline_receive_after_a_send_is_waited_on_a_coalescing_backend(coalescing_backend):
    """An even pipeline rank lists a batch's sends first: its receive must still be waited before the
    received tensor is used (on CUDA, the wait is what orders NCCL's write before the compute)."""
    from parallel.pipeline.runtime import PipelineRuntime
    from parallel.pipeline.schedule import BACKWARD, FORWARD, RECV_F, SEND_B, Action

    program = [Action(0, FORWARD, 0, 0), Action(0, FORWARD, 1, 0), Action(0, BACKWARD, 1, 0), Action(0, BACKWARD, 0, 0)]
    runtime = PipelineRuntime(program, 2, [torch.nn.Identity(), torch.nn.Identity()], [None, None],
                              comm.dist.group.WORLD, (2,), torch.float32, torch.device("cpu"))
    runtime._outbox[(BACKWARD, 1, 0)] = torch.zeros(2)
    runtime._exchange([Action(0, SEND_B, 1, 0, peer=1), Action(0, RECV_F, 1, 0, peer=1)])
    assert coalescing_backend.waits >= 1
    assert (FORWARD, 2, 0) in runtime._inbox
