"""Pipeline schedules as data: one list of actions per rank, readable, diffable, simulatable.

A pipeline of `pp` ranks with `vpp` model chunks per rank has pp x vpp virtual stages; chunk c of rank
r is stage c * pp + r (in a V under zbv: layers.stage_index). A microbatch's forward runs through the
stages in order, its backward in reverse.

Building a schedule has two parts:

1. The compute order of each rank, from the schedule's rule: `gpipe` (all forwards, then all
   backwards), `1f1b` (PipeDream-flush: warm-up forwards, steady one-forward-one-backward, cool-down
   backwards), `interleaved_1f1b` (Megatron's order over groups of microbatches, the groups
   searched: see interleaved_groups), or a zero-bubble one, whose backwards are split into B, the input
   gradient, and W, the weight gradients, deferred to fill the bubble (zero_bubble.py): `zb_h1` (1F1B's
   order, one chunk per rank) or `zbv` (two chunks per rank placed in a V, see layers.py). As in
   Megatron, `1f1b` over more than one chunk per rank is the interleaved one: virtual stages alone
   turn interleaving on.
2. The point-to-point transfers, placed by list-scheduling the compute orders with unit costs
   (forward 1, backward 2, or B 1 and W 1 when split): the transfer of an output finished at time t goes into communication
   batch "t" of both sender and receiver. Every rank's batches are then in increasing t, and each
   batch's operations are matched by batches of the same t on the peers, so no rank can wait on a
   batch that waits on it: no deadlock by construction, with NCCL's blocking semantics (a send waits
   for its receive) as much as with gloo's. A deadlocking compute order is caught while placing.

Consecutive SEND/RECV actions form one batch (its sends and its receives each posted as one
`batch_isend_irecv` per channel, see channels.py: on NCCL, where a communicator's calls run in order,
the argument above needs a receive never queued behind a send, which the channels give); inside a
batch, even ranks list sends first and odd ranks receives first (Megatron's pairing by parity for
unbatched p2p). Batched, the order is not what makes progress: with an odd pp and several chunks,
ranks pp-1 and 0 are both even.
"""

from functools import lru_cache

from parallel.errors import ConfigError
from parallel.pipeline.actions import BACKWARD, FORWARD, RECV_B, RECV_F, SEND_B, SEND_F, WEIGHT, Action
from parallel.pipeline.layers import stage_index, stage_place
from parallel.pipeline.zero_bubble import zero_bubble_h1, zero_bubble_v

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "zbv")
# Unit costs used to place transfers: a backward computes two matmuls per forward one, one for the
# input gradient (B) and one for the weights' (W).
_PLACEMENT_COST = {FORWARD: 1, BACKWARD: 2, WEIGHT: 1}


def effective_schedule(schedule: str, vpp: int) -> str:
    """The schedule a rank runs: `1f1b` with virtual stages is the interleaved 1F1B."""
    return "interleaved_1f1b" if schedule == "1f1b" and vpp > 1 else schedule


# How virtual stages are counted, for the refusals that ask for a number of them.
_STAGES = (" (model.n_layers / num_layers_per_virtual_pipeline_stage, where pipeline_first_stage_layers and "
           "pipeline_last_stage_layers, if set, are one stage each and not in n_layers)")


def check_layout(schedule: str, vpp: int) -> None:
    """Which schedules take virtual stages; one line naming the keys otherwise."""
    if schedule not in SCHEDULES:
        raise ConfigError(f"pipeline_schedule={schedule} is not one of: {' | '.join(SCHEDULES)}")
    if schedule == "interleaved_1f1b" and vpp < 2:
        raise ConfigError(
            f"pipeline_schedule=interleaved_1f1b needs at least 2 virtual stages per rank, got {vpp} (set "
            f"num_layers_per_virtual_pipeline_stage so that the stages number at least 2 x pipeline_parallel_size{_STAGES})"
        )
    if schedule == "gpipe" and vpp > 1:
        raise ConfigError(
            f"pipeline_schedule=gpipe runs one chunk per rank, but num_layers_per_virtual_pipeline_stage "
            f"gives {vpp}; use pipeline_schedule=1f1b (interleaved) or unset num_layers_per_virtual_pipeline_stage"
        )
    if schedule == "zb_h1" and vpp > 1:
        raise ConfigError(
            f"pipeline_schedule=zb_h1 runs one chunk per rank, but num_layers_per_virtual_pipeline_stage "
            f"gives {vpp}; unset num_layers_per_virtual_pipeline_stage or use pipeline_schedule=1f1b (interleaved)"
        )
    if schedule == "zbv" and vpp != 2:
        raise ConfigError(
            f"pipeline_schedule=zbv runs exactly 2 chunks per rank, got {vpp}: set "
            f"num_layers_per_virtual_pipeline_stage so that the stages number 2 x pipeline_parallel_size{_STAGES}"
        )


def compute_order(schedule: str, pp: int, vpp: int, microbatches: int, rank: int) -> list[Action]:
    """The forwards and backwards of one rank, in the order the schedule runs them."""
    check_layout(schedule, vpp)
    schedule = effective_schedule(schedule, vpp)
    if microbatches < 1:
        raise ConfigError(f"the number of microbatches (batch_size / microbatch_size) must be >= 1, got {microbatches}")
    if schedule == "interleaved_1f1b":
        return _interleaved_order(pp, vpp, rank, *interleaved_groups(pp, vpp, microbatches))
    if schedule == "zb_h1":
        return zero_bubble_h1(pp, microbatches, rank)
    if schedule == "zbv":
        return zero_bubble_v(pp, microbatches, rank)
    forwards = [(0, mb) for mb in range(microbatches)]
    warmup = microbatches if schedule == "gpipe" else min(pp - rank - 1, microbatches)
    return _one_f_one_b(rank, forwards, forwards, warmup)


def _interleaved_order(pp: int, vpp: int, rank: int, groups: tuple[int, ...], warmup_group: int) -> list[Action]:
    """Megatron's interleaved 1F1B over consecutive groups of microbatches of the given sizes: each group
    runs through every chunk before the next starts; backwards visit the chunks in reverse. The warm-up
    is Megatron's for groups of `warmup_group` (at least the largest group: a rank's backward of a
    group's first microbatch waits for its forward in the last chunk)."""
    forwards, first = [], 0
    for size in groups:
        forwards += [(chunk, mb) for chunk in range(vpp) for mb in range(first, first + size)]
        first += size
    backwards = [(vpp - 1 - chunk, mb) for chunk, mb in forwards]
    warmup = min((pp - rank - 1) * 2 + (vpp - 1) * warmup_group, len(forwards))
    return _one_f_one_b(rank, forwards, backwards, warmup)


def interleaved_partitions(microbatches: int, group: int) -> list[tuple[int, ...]]:
    """The group sizes tried with a warm-up for groups of `group`: Megatron's (the remainder last), the
    remainder first (its short group then idles the ranks in the warm-up, where they wait anyway), and
    the microbatches spread evenly over ceil(M / group) groups, the smaller first."""
    count, remainder = divmod(microbatches, group)
    if not remainder:
        return [(group,) * count]
    spread = divmod(microbatches, count + 1)
    even = (spread[0],) * (count + 1 - spread[1]) + (spread[0] + 1,) * spread[1]
    return list(dict.fromkeys([(group,) * count + (remainder,), (remainder,) + (group,) * count, even]))


@lru_cache(maxsize=64)
def interleaved_groups(pp: int, vpp: int, microbatches: int) -> tuple[tuple[int, ...], int]:
    """The interleaved order's group sizes and warm-up group, searched: for each warm-up group size
    from pp to M (M when M < pp), the sizes of interleaved_partitions.

    The order that finishes first at unit costs wins (with the runtime's transfers the simulator's
    makespan is the same); ties go to the smaller peak (it grows with the warm-up group), then to the
    earlier partition. Orders whose peak exceeds interleaved_peak_bound are skipped, unless none within
    it schedules and is as fast as plain 1F1B: then the smallest peak that is (or, were there none,
    the fastest within the bound, else the smallest peak that schedules). An order reaching the
    pipeline's lower bound ends the search, so a multiple of pp takes one list schedule."""
    sizes = range(min(pp, microbatches), microbatches + 1)
    limit = interleaved_peak_bound(pp, vpp, microbatches)
    within = [w for w in sizes if interleaved_peak(pp, vpp, microbatches, w) <= limit]  # a prefix
    # No rank r can end before r forwards, its own vpp x M forwards and backwards, and the r backwards
    # of chunk 0 that carry its last input gradient to rank 0.
    ideal = (_PLACEMENT_COST[FORWARD] + _PLACEMENT_COST[BACKWARD]) * (vpp * microbatches + pp - 1)
    best = None
    for span, groups, w in _scheduling_orders(pp, vpp, microbatches, within):
        if best is None or span < best[0]:
            best = (span, groups, w)
        if span == ideal:
            break
    plain = vpp * _one_f_one_b_makespan(pp, microbatches)  # a chunk costs 1/vpp of a stage
    if best is not None and best[0] <= plain:
        return best[1:]
    fallback = None
    for span, groups, w in _scheduling_orders(pp, vpp, microbatches, sizes[len(within):]):
        if span <= plain:
            return groups, w
        fallback = fallback or (groups, w)
    return best[1:] if best is not None else fallback


def _scheduling_orders(pp: int, vpp: int, microbatches: int, warmup_groups: list[int] | range):
    """(makespan, groups, warm-up group) of each candidate order that schedules, warm-up group by
    warm-up group."""
    for w in warmup_groups:
        for groups in interleaved_partitions(microbatches, w):
            span = _interleaved_makespan(pp, vpp, groups, w)
            if span is not None:
                yield span, groups, w


def interleaved_peak_bound(pp: int, vpp: int, microbatches: int) -> int:
    """The most chunk activations an order may hold on rank 0: 1F1B's min(pp, M) microbatches plus vpp
    (a chunk holds 1/vpp of a stage), or what Megatron's own group of pp holds where that is more (at
    vpp=2 from pp=6 its warm-up alone exceeds the first)."""
    return max((min(pp, microbatches) + vpp) * vpp, interleaved_peak(pp, vpp, microbatches, min(pp, microbatches)))


def interleaved_peak(pp: int, vpp: int, microbatches: int, warmup_group: int) -> int:
    """Chunk activations rank 0 holds at most under a warm-up for groups of `warmup_group` (the most of
    any rank: its warm-up is the longest), whatever the group sizes: its warm-up forwards, plus the
    first steady forward before the first backward frees one."""
    forwards = vpp * microbatches
    warmup = min((pp - 1) * 2 + (vpp - 1) * warmup_group, forwards)
    return warmup + 1 if warmup < forwards else warmup


def _interleaved_makespan(pp: int, vpp: int, groups: tuple[int, ...], warmup_group: int) -> int | None:
    """When the order with these groups ends, list-scheduled at unit costs (the clock the transfers are
    placed on; the simulator's, with its transfer batches, costs three times as much); None when it
    deadlocks."""
    orders = [_interleaved_order(pp, vpp, r, groups, warmup_group) for r in range(pp)]
    try:
        return max(_list_schedule(orders, pp, vpp, "interleaved_1f1b", sum(groups))[1].values())
    except ConfigError:
        return None


def _one_f_one_b_makespan(pp: int, microbatches: int) -> int:
    orders = [compute_order("1f1b", pp, 1, microbatches, r) for r in range(pp)]
    return max(_list_schedule(orders, pp, 1, "1f1b", microbatches)[1].values())


def _one_f_one_b(rank: int, forwards: list, backwards: list, warmup: int) -> list[Action]:
    """`warmup` forwards, then alternate one forward and one backward, then the remaining backwards."""
    order = [Action(rank, FORWARD, c, mb) for c, mb in forwards[:warmup]]
    for (fc, fmb), (bc, bmb) in zip(forwards[warmup:], backwards):
        order += [Action(rank, FORWARD, fc, fmb), Action(rank, BACKWARD, bc, bmb)]
    done = len(forwards) - warmup
    order += [Action(rank, BACKWARD, c, mb) for c, mb in backwards[done:]]
    return order


def splits_backward(schedule: str) -> bool:
    """Whether the schedule's backwards are B (input gradient) plus a later W (weight gradients)."""
    return schedule in ("zb_h1", "zbv")


def v_shaped(schedule: str) -> bool:
    """Whether the schedule places its stages in a V (layers.stage_index) rather than a loop."""
    return schedule == "zbv"


def stage_of(action: Action, pp: int, v_shape: bool = False) -> int:
    return stage_index(pp, action.rank, action.chunk, v_shape)


def upstream(stage: int, op: str, num_stages: int) -> int | None:
    """The stage whose output this stage's op consumes: the previous stage's activation for a
    forward, the next stage's input gradient for a backward; None at the pipeline's ends, and for W
    (it reads what its own B left)."""
    if op == WEIGHT:
        return None
    if op == FORWARD:
        return stage - 1 if stage > 0 else None
    return stage + 1 if stage < num_stages - 1 else None


def downstream(stage: int, op: str, num_stages: int) -> int | None:
    """The stage that consumes this stage's output of op: the next stage's forward takes a forward's
    activation, the previous stage's backward a backward's input gradient; None at the ends, and
    for W (nothing waits for it)."""
    if op == WEIGHT:
        return None
    if op == FORWARD:
        return stage + 1 if stage < num_stages - 1 else None
    return stage - 1 if stage > 0 else None


@lru_cache(maxsize=64)
def pipeline_actions(schedule: str, pp: int, vpp: int, microbatches: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's program: compute actions with their transfers placed (see the module docstring)."""
    orders = [compute_order(schedule, pp, vpp, microbatches, r) for r in range(pp)]
    start, end = _list_schedule(orders, pp, vpp, schedule, microbatches)
    num_stages, v_shape = pp * vpp, v_shaped(schedule)
    batches: dict[tuple[int, int], list[Action]] = {}  # (rank, slot time) -> transfers
    for order in orders:
        for a in order:
            consumer = downstream(stage_of(a, pp, v_shape), a.op, num_stages)
            if consumer is None:
                continue  # the pipeline's end
            (peer, chunk), slot = stage_place(consumer, pp, v_shape), end[a]
            if peer == a.rank:
                continue  # a hand-over between chunks of one rank
            send, recv = (SEND_F, RECV_F) if a.op == FORWARD else (SEND_B, RECV_B)
            batches.setdefault((a.rank, slot), []).append(Action(a.rank, send, a.chunk, a.microbatch, peer))
            batches.setdefault((peer, slot), []).append(Action(peer, recv, chunk, a.microbatch, a.rank))
    programs = []
    for rank, order in enumerate(orders):
        # A batch at slot t runs after computes that started before t and before those starting at t.
        keyed = [((start[a], 1), [a]) for a in order]
        keyed += [((slot, 0), _parity_sorted(ops, rank)) for (r, slot), ops in batches.items() if r == rank]
        programs.append(tuple(a for _, group in sorted(keyed, key=lambda k: k[0]) for a in group))
    return tuple(programs)


def _parity_sorted(ops: list[Action], rank: int) -> list[Action]:
    sends_first = rank % 2 == 0
    return sorted(ops, key=lambda a: (a.op.startswith("SEND") != sends_first, a.peer, a.op, a.microbatch))


def _list_schedule(orders: list[list[Action]], pp: int, vpp: int, schedule: str, microbatches: int):
    """Start and end time of every compute action at unit costs, each as early as its rank and its
    inputs allow. Raises ConfigError when the orders wait on each other forever."""
    num_stages, v_shape = pp * vpp, v_shaped(schedule)
    done: dict[tuple[str, int, int], int] = {}  # (op, stage, mb) -> end time
    start: dict[Action, int] = {}
    end: dict[Action, int] = {}
    position, free_at = [0] * pp, [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                a = order[position[rank]]
                ready = _ready_time(a, pp, num_stages, done, v_shape)
                if ready is None:
                    break
                start[a] = max(free_at[rank], ready)
                cost = 1 if a.op == BACKWARD and splits_backward(schedule) else _PLACEMENT_COST[a.op]
                end[a] = free_at[rank] = start[a] + cost
                done[(a.op, stage_of(a, pp, v_shape), a.microbatch)] = end[a]
                position[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            raise ConfigError(
                f"pipeline_schedule={schedule} has no valid order for {microbatches} microbatches "
                f"(batch_size / microbatch_size) with pipeline_parallel_size={pp} and {vpp} chunks per rank"
            )
    return start, end


def _ready_time(a: Action, pp: int, num_stages: int, done: dict, v_shape: bool) -> int | None:
    """When a compute action's inputs exist (None: not yet computed)."""
    stage = stage_of(a, pp, v_shape)
    needs = []
    if a.op in (BACKWARD, WEIGHT):  # a backward after its forward, a W after its B
        needs.append((FORWARD if a.op == BACKWARD else BACKWARD, stage, a.microbatch))
    source = upstream(stage, a.op, num_stages)
    if source is not None:
        needs.append((a.op, source, a.microbatch))
    if any(n not in done for n in needs):
        return None
    return max((done[n] for n in needs), default=0)


def transfer_key(a: Action, pp: int, num_stages: int, v_shape: bool = False) -> tuple[str, int, int]:
    """What a SEND/RECV carries, the same on both sides: (the op that consumes it, the consuming
    stage, microbatch)."""
    stage = stage_of(a, pp, v_shape)
    if a.op in (RECV_F, RECV_B):
        return (FORWARD if a.op == RECV_F else BACKWARD, stage, a.microbatch)
    op = FORWARD if a.op == SEND_F else BACKWARD
    return (op, downstream(stage, op, num_stages), a.microbatch)


def batched(program: list[Action]) -> list[list[Action]]:
    """A program as steps: a compute action alone, or a run of consecutive transfers (one batch)."""
    steps: list[list[Action]] = []
    for a in program:
        if not a.is_compute and steps and not steps[-1][0].is_compute:
            steps[-1].append(a)
        else:
            steps.append([a])
    return steps


def following_batches(steps: list[list[Action]]) -> list[list[Action]]:
    """For each step of `batched`'s, the first communication batch after it (empty when none follows):
    the batch whose receives a runtime posting ahead sends out at that step."""
    following, upcoming = [], []
    for step in reversed(steps):
        following.append(upcoming)
        if not step[0].is_compute:
            upcoming = step
    return following[::-1]


def schedule_actions(schedule: str, pp: int, vpp: int, microbatches: int, rank: int) -> list[Action]:
    """One rank's program: `(pp, vpp, num_microbatches, rank) -> list[Action]`."""
    return list(pipeline_actions(schedule, pp, vpp, microbatches)[rank])


def forward_only(program: list[Action]) -> list[Action]:
    """The forwards of a program and their transfers (evaluation): a subset of a deadlock-free order,
    with every batch still matched slot by slot, is deadlock-free."""
    return [a for a in program if a.op in (FORWARD, SEND_F, RECV_F)]
