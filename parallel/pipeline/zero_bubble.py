"""Zero-bubble compute orders (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): each backward is
split into B, the input gradient the previous stage waits for, and W, the weight gradients, which
nothing downstream waits for and which the order moves into what would otherwise be idle time.

Both orders run each chunk's Ws in the order of its Bs, so a chunk's last W is its last B's: the W
that runs FSDP's one reduction of the step.
"""

from parallel.pipeline.actions import BACKWARD, FORWARD, WEIGHT, Action


def zero_bubble_h1(pp: int, microbatches: int, rank: int) -> list[Action]:
    """ZB-H1, one chunk per rank: 1F1B's order of forwards and Bs, each B followed by a W; rank r holds
    its first r Ws back, runs the later ones r behind their B and the held ones at the end, where they
    fill the cool-down's wait for Bs from downstream. A microbatch's activations live from F to W: at
    most pp on any rank, as in 1F1B."""
    warmup = min(pp - rank - 1, microbatches)
    order = [Action(rank, FORWARD, 0, mb) for mb in range(warmup)]
    weights = 0
    for mb in range(microbatches):
        if warmup + mb < microbatches:
            order.append(Action(rank, FORWARD, 0, warmup + mb))
        order.append(Action(rank, BACKWARD, 0, mb))
        if mb >= rank:
            order.append(Action(rank, WEIGHT, 0, weights))
            weights += 1
    return order + [Action(rank, WEIGHT, 0, mb) for mb in range(weights, microbatches)]


class _VOrder:
    """One rank's ZB-V order as it is built: the next forward, B and W microbatch of each chunk."""

    def __init__(self, rank: int):
        self.rank, self.actions = rank, []
        self.next = {FORWARD: [0, 0], BACKWARD: [0, 0], WEIGHT: [0, 0]}

    def add(self, op: str, chunk: int, times: int = 1) -> None:
        for _ in range(times):
            self.actions.append(Action(self.rank, op, chunk, self.next[op][chunk]))
            self.next[op][chunk] += 1

    def backward(self, chunk: int) -> None:
        self.add(BACKWARD, chunk)
        self.add(WEIGHT, chunk)


def zero_bubble_v(pp: int, microbatches: int, rank: int) -> list[Action]:
    """ZB-V (the paper's section 6; torch.distributed.pipelining's ScheduleZBVZeroBubble runs the same
    order): two chunks per rank placed in a V (layers.stage_index), so that rank 0 runs both the first
    and the last stage. Warm-up: 2(pp - r) - 1 forwards of chunk 0, then r pairs of forwards (chunk 1,
    chunk 0), then pp - r rounds of chunk 1's forward, B and W. Steady: a forward, B and W of chunk 0,
    then of chunk 1. Cool-down: r pairs of Bs (chunk 0, chunk 1) with their Ws held back, pp - r of
    chunk 0's B each with its oldest held W, then the held Ws, chunk 1's first. At equal F, B and W
    costs the bubble is about half of ZB-H1's, with the same activation memory per rank (2pp chunk
    microbatches, pp whole-stage ones). The order is built for at least 2pp - 1 microbatches and the
    microbatches past M dropped."""
    built = max(2 * pp - 1, microbatches)
    v = _VOrder(rank)
    v.add(FORWARD, 0, 2 * (pp - rank) - 1)
    for _ in range(rank):
        v.add(FORWARD, 1)
        v.add(FORWARD, 0)
    for _ in range(pp - rank):
        v.add(FORWARD, 1)
        v.backward(1)
    while v.next[FORWARD][1] < v.next[FORWARD][0] or v.next[FORWARD][0] < built:
        if v.next[FORWARD][0] < built:
            v.add(FORWARD, 0)
        v.backward(0)
        v.add(FORWARD, 1)
        v.backward(1)
    for _ in range(rank):
        v.add(BACKWARD, 0)
        v.add(BACKWARD, 1)
    for _ in range(pp - rank):
        v.backward(0)
    for chunk in (1, 0):
        v.add(WEIGHT, chunk, v.next[BACKWARD][chunk] - v.next[WEIGHT][chunk])
    return [a for a in v.actions if a.microbatch < microbatches]
