"""Which communicator carries each pipeline transfer, so that on NCCL a receive never waits for a send.

NCCL gives one work per `batch_isend_irecv` call and runs a communicator's works in order on one
stream. A receive in the same call as a send, or on the same communicator, therefore completes only
once that send's peer has posted its receive, which may be much later. So transfers are spread over
channels: communicators over the same pipeline ranks, one per (direction, link colour). Activations
go from rank r to r+1 and gradients from r+1 to r, over link r; links are coloured r % 2, and for an
odd P with virtual stages the wrap-around link P-1 -> 0 gets a third colour. A rank's two links then
differ in colour, so on every channel a rank only sends or only receives, and a batch becomes one
call per channel. gloo gives a work per operation, so there one channel does the same.
"""

from parallel.pipeline.schedule import RECV_B, RECV_F, SEND_F, Action


def _colour(link: int, pp: int) -> int:
    return 2 if pp % 2 and link == pp - 1 else link % 2


def channel_count(pp: int, vpp: int) -> int:
    """Communicators a pipeline of pp ranks and vpp chunks per rank spreads its transfers over."""
    links = range(pp if vpp > 1 else pp - 1)  # link pp-1 (back to rank 0) only carries virtual stages
    return 2 * len({_colour(link, pp) for link in links}) if pp > 1 else 1


def channel_of(a: Action, pp: int, vpp: int) -> int:
    """The channel of a SEND/RECV: activations on the first half, gradients on the second."""
    upstream_rank = a.rank if a.op in (SEND_F, RECV_B) else a.peer  # the link is named by its upstream end
    colours = channel_count(pp, vpp) // 2
    return (0 if a.op in (SEND_F, RECV_F) else colours) + _colour(upstream_rank, pp)


def split_batch(batch: list[Action], pp: int, vpp: int, channels: int) -> list[tuple[int, list[Action]]]:
    """A communication batch as (channel, its operations) calls, by increasing channel, the posting order
    on every rank; with one channel, the batch whole."""
    if channels == 1:
        return [(0, batch)]
    calls: dict[int, list[Action]] = {}
    for a in batch:
        calls.setdefault(channel_of(a, pp, vpp), []).append(a)
    return sorted(calls.items())
