"""Pipeline transfers spread over channels (communicators over the same ranks): on each channel a rank
only sends or only receives, the two ends of a channel post their transfers in the same order, and the
runtime posts each call with only sends or only receives (on the CPU the receives a batch ahead), and on
CUDA refuses fewer channels."""

import itertools
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from parallel import comm
from parallel.pipeline.channels import channel_count, split_batch
from parallel.pipeline.runtime import PipelineRuntime, PlainChunkRoot
from parallel.pipeline.schedule import (
    batched, forward_only, pipeline_actions, schedule_actions, transfer_key, v_shaped,
)


def _layouts():
    for pp, vpp in itertools.product(range(2, 9), range(1, 5)):
        for m in sorted({pp, pp + 1, 2 * pp}):
            yield ("interleaved_1f1b" if vpp > 1 else "1f1b"), pp, vpp, m
            if vpp == 2:
                yield "zbv", pp, vpp, m


def _calls(program, pp: int, vpp: int):
    for step in batched(list(program)):
        if not step[0].is_compute:
            yield from split_batch(step, pp, vpp, channel_count(pp, vpp))


def test_on_each_channel_a_rank_only_sends_or_only_receives_in_its_peers_order():
    for schedule, pp, vpp, m in _layouts():
        sequences = {}  # (channel, sender, receiver, is_send) -> transfer keys in posting order
        kinds = {}  # (rank, channel) -> {"SEND", "RECV"}
        for rank, program in enumerate(pipeline_actions(schedule, pp, vpp, m)):
            for channel, call in _calls(program, pp, vpp):
                for a in call:
                    kind = a.op[:4]
                    kinds.setdefault((rank, channel), set()).add(kind)
                    pair = (rank, a.peer) if kind == "SEND" else (a.peer, rank)
                    sequences.setdefault((channel, *pair, kind == "SEND"), []).append(
                        transfer_key(a, pp, pp * vpp, v_shaped(schedule)))
        assert all(len(k) == 1 for k in kinds.values()), (schedule, pp, vpp, m, kinds)
        assert max(c for _, c in kinds) < channel_count(pp, vpp)
        for (channel, sender, receiver, is_send), keys in sequences.items():
            if is_send:
                assert sequences[(channel, sender, receiver, False)] == keys, (pp, vpp, m, channel, sender)


class _Work:
    def __init__(self, log: list, call: int) -> None:
        self.log, self.call = log, call

    def wait(self) -> bool:
        self.log.append(("wait", self.call))
        return True


def test_the_runtime_posts_sends_and_receives_in_calls_of_their_own(world, monkeypatch):
    """A coalescing backend (NCCL's one work per call), channels as distinct groups: at each batch the
    runtime posts the batch's sends, one call per channel, then its receives, or (receiving ahead, as on
    the CPU) the next batch's (the first batch's own before), each call only sending or only receiving,
    each on its channel's group; receiving ahead, a batch's receives are waited only after the next
    batch's are posted. Training steps and forward-only ones (evaluation), 1F1B, interleaved, zb_h1 and zbv."""
    log, posted = [], []

    def coalescing(p2p):
        for op in p2p:
            if op.op is dist.irecv:
                op.tensor.zero_()
        posted.append((p2p[0].group, [(op.op is dist.isend, op.peer) for op in p2p]))
        log.append(("post", len(posted) - 1))
        return [_Work(log, len(posted) - 1)]

    monkeypatch.setattr(comm.dist, "batch_isend_irecv", coalescing)
    # The channels are one-rank groups here, which torch's P2POp would refuse a peer of.
    monkeypatch.setattr(comm.dist, "P2POp", lambda op, tensor, group, group_peer: SimpleNamespace(
        op=op, tensor=tensor, group=group, peer=group_peer))
    cases = itertools.product((("1f1b", 2, 2), ("1f1b", 3, 2), ("1f1b", 4, 1), ("zb_h1", 3, 1), ("zbv", 3, 2)),
                              (False, True),
                              (False, True))
    for (schedule, pp, vpp), receives_ahead, forward in cases:
        channels = [dist.new_group([0]) for _ in range(channel_count(pp, vpp))]
        for rank in range(pp):
            program = schedule_actions(schedule, pp, vpp, 2 * pp, rank)
            runtime = PipelineRuntime(program, pp, [torch.nn.Linear(4, 4) for _ in range(vpp)],
                                      [PlainChunkRoot()] * vpp, channels[0], (2, 4), torch.float32, torch.device("cpu"),
                                      channels, v_shaped(schedule))
            runtime.receives_ahead = receives_ahead
            log.clear(), posted.clear()
            if forward:
                with torch.no_grad():
                    runtime.run_forward(lambda mb: torch.ones(2, 4), lambda y, mb: y.sum())
            else:
                runtime.run_step(lambda mb: torch.ones(2, 4), lambda y, mb: y.sum())
            batches = _transfer_steps(forward_only(program) if forward else program)
            expected, batch_of = [], []
            for b in range(len(batches)):
                receives = ([b] if b == 0 else []) + [b + 1] if receives_ahead else [b]
                for index, sends in [(b, True)] + [(k, False) for k in receives if k < len(batches)]:
                    for c, call in _one_kind(batches[index], sends, pp, vpp, len(channels)):
                        expected.append((channels[c], [(sends, a.peer) for a in call]))
                        batch_of.append(index)
            case = (schedule, pp, vpp, rank, receives_ahead, forward)
            assert posted == expected, case
            for i, (event, call) in enumerate(log):
                if receives_ahead and event == "wait" and not posted[call][1][0][0]:  # a receive waited
                    ahead = [c for e, c in log[:i] if e == "post" and batch_of[c] == batch_of[call] + 1]
                    following = [c for c, b in enumerate(batch_of) if b == batch_of[call] + 1 and not posted[c][1][0][0]]
                    assert ahead == following, (case, call)


def test_the_runtime_on_cuda_refuses_fewer_channels_and_does_not_receive_ahead(world):
    """On one NCCL stream a batch's receive would queue behind its send and the peer's likewise; and a
    receive posted ahead could be waited by a device-wide synchronization before this rank's own send
    its data depends on."""
    program = schedule_actions("1f1b", 2, 1, 4, 0)
    with pytest.raises(ValueError, match=rf"pipeline runtime on CUDA needs {channel_count(2, 1)} channels .* got 1"):
        PipelineRuntime(program, 2, [torch.nn.Linear(4, 4)], [PlainChunkRoot()], dist.group.WORLD, (2, 4), torch.float32,
                        torch.device("cuda"))
    channels = [dist.group.WORLD] * channel_count(2, 1)
    cuda = PipelineRuntime(program, 2, [torch.nn.Linear(4, 4)], [PlainChunkRoot()], channels[0], (2, 4), torch.float32,
                           torch.device("cuda"), channels)
    cpu = PipelineRuntime(program, 2, [torch.nn.Linear(4, 4)], [PlainChunkRoot()], channels[0], (2, 4), torch.float32,
                          torch.device("cpu"), channels)
    assert not cuda.receives_ahead and cpu.receives_ahead


def _one_kind(batch, sends: bool, pp: int, vpp: int, channels: int):
    """A batch's sends (or receives) as the runtime's calls: (channel, actions)."""
    for c, call in split_batch(batch, pp, vpp, channels):
        mine = [a for a in call if a.op.startswith("SEND") == sends]
        if mine:
            yield c, mine


def _transfer_steps(program):
    return [step for step in batched(list(program)) if not step[0].is_compute]
