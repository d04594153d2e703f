"""Pipeline transfers spread over channels (communicators over the same ranks): on each channel a rank
only sends or only receives, the two ends of a channel post their transfers in the same order, and the
runtime posts exactly the calls the simulator's NCCL mode times (one coalesced work per call)."""

import itertools
from types import SimpleNamespace

import torch
import torch.distributed as dist

from parallel import comm
from parallel.pipeline.channels import channel_count, split_batch
from parallel.pipeline.runtime import PipelineRuntime
from parallel.pipeline.schedule import batched, schedule_actions, pipeline_actions, transfer_key


def _layouts():
    for pp, vpp in itertools.product(range(2, 9), range(1, 5)):
        for m in sorted({pp, pp + 1, 2 * pp}):
            yield ("interleaved_1f1b" if vpp > 1 else "1f1b"), pp, vpp, m


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
                        transfer_key(a, pp, pp * vpp))
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


def test_the_runtime_posts_one_call_per_channel_and_waits_receives_after_posting_all(world, monkeypatch):
    """A coalescing backend (NCCL's one work per call), channels as distinct groups: the runtime's calls
    are split_batch's, in order, each on its channel's group, and a batch's receives are waited only
    once all its calls are posted (on NCCL a wait first would hold back the later calls)."""
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
    for pp, vpp in ((2, 2), (3, 2), (4, 1)):
        channels = [dist.new_group([0]) for _ in range(channel_count(pp, vpp))]
        for rank in range(pp):
            program = schedule_actions("1f1b", pp, vpp, 2 * pp, rank)
            runtime = PipelineRuntime(program, pp, [torch.nn.Linear(4, 4) for _ in range(vpp)],
                                      [_Root()] * vpp, channels[0], (2, 4), torch.float32, torch.device("cpu"),
                                      channels)
            log.clear(), posted.clear()
            runtime.run_step(lambda mb: torch.ones(2, 4), lambda y, mb: y.sum())
            expected = [(channels[c], [(a.op.startswith("SEND"), a.peer) for a in call])
                        for c, call in _calls(program, pp, vpp)]
            assert posted == expected, (pp, vpp, rank)
            batch_of = [b for b, step in enumerate(_transfer_steps(program))
                        for _ in split_batch(step, pp, vpp, len(channels))]
            for i, (event, call) in enumerate(log):
                if event == "wait" and posted[call][1][0][0] is False:  # a receive waited
                    later = [c for e, c in log[i:] if e == "post"]
                    assert all(batch_of[c] != batch_of[call] for c in later), (pp, vpp, rank, call)


def _transfer_steps(program):
    return [step for step in batched(list(program)) if not step[0].is_compute]


class _Root:
    def set_microbatch(self, is_first: bool, is_last: bool) -> None:
        pass

    def clear_microbatch(self) -> None:
        pass
