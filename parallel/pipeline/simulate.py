"""Run the ranks' action lists on a clock instead of on devices: timeline, bubble, memory, picture.

No process group is needed. Each rank executes its program in order; a compute action takes its cost;
a communication batch posts all its operations when the rank reaches it and completes when every
operation's counterpart has been posted by its peer (plus the p2p cost). By default the rank waits for
that (`sends_block=True`): a send waits for its receive, the strictest semantics, so a program that
completes here cannot deadlock on a real backend. `sends_block=False` times what the runtime does: at
each batch it waits for the previous batch's sends, posts this batch's sends and receives, and waits for
this batch's receives only; `receives_ahead=True` (the runtime on the CPU, gloo) posts each batch's
receives at the batch before. (The runtime posts receives and sends in calls of their own, one per
channel, so on NCCL, whose calls are one work each, waiting a receive waits only receives of the same
batch. A channel's works run in order, which never binds here: a rank waits its sends before posting
more, and posts its receives in the order the peer sends.) A cost function prices a backward's two
halves apart, B (the input gradient) and W (the weight gradients); a program without W actions runs both
halves in its B. The simulation also checks that every compute finds its input already
there and every send is received, so it validates the schedule it times.
"""

import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from parallel.pipeline.layers import stage_place
from parallel.pipeline.schedule import (
    BACKWARD, FORWARD, WEIGHT, Action, batched, downstream, following_batches, stage_of, transfer_key, upstream,
)

CostFn = Callable[[Action], float]


class ScheduleError(RuntimeError):
    """An action list that deadlocks or computes before its input exists."""


def uniform_costs(forward: float = 1.0, backward: float = 2.0, p2p: float = 0.0, weight: float | None = None) -> CostFn:
    """`backward` is a whole backward's cost, of which `weight` (half by default) is W's."""
    weight = backward / 2 if weight is None else weight
    costs = {FORWARD: forward, BACKWARD: backward - weight, WEIGHT: weight}
    return lambda a: costs.get(a.op, p2p)


def random_costs(seed: int) -> CostFn:
    """Every action its own cost, drawn once: the stress test of an order's independence of timing."""
    rng, drawn = random.Random(seed), {}

    def cost(a: Action) -> float:
        if a not in drawn:
            drawn[a] = rng.uniform(0.2, 3.0) if a.is_compute else rng.uniform(0.0, 0.5)
        return drawn[a]

    return cost


@dataclass
class Span:
    action: Action
    start: float
    end: float


@dataclass
class Timeline:
    pp: int
    vpp: int
    spans: list[list[Span]] = field(default_factory=list)  # per rank: compute spans in run order
    peak_in_flight: list[int] = field(default_factory=list)  # per rank: (chunk, microbatch) activations held

    @property
    def makespan(self) -> float:
        return max((s.end for rank in self.spans for s in rank), default=0.0)

    def busy(self, rank: int) -> float:
        return sum(s.end - s.start for s in self.spans[rank])

    @property
    def bubble_fraction(self) -> float:
        """Mean over ranks of the share of the makespan a rank spends idle."""
        makespan = self.makespan
        return sum(1.0 - self.busy(r) / makespan for r in range(self.pp)) / self.pp

    @property
    def peak_microbatches(self) -> list[float]:
        """Peak activations held per rank, in whole-stage microbatches (a chunk holds 1/vpp of a stage)."""
        return [p / self.vpp for p in self.peak_in_flight]


class _Simulation:
    def __init__(self, programs: list[list[Action]], pp: int, vpp: int, cost: CostFn, sends_block: bool,
                 receives_ahead: bool, v_shape: bool):
        self.pp, self.vpp, self.num_stages, self.cost, self.sends_block = pp, vpp, pp * vpp, cost, sends_block
        self.v_shape = v_shape
        self.receives_ahead = receives_ahead and not sends_block
        self.unwaited: list[list[tuple]] = [[] for _ in range(pp)]  # per rank: ((key, True), action) of sends
        self.splits = [any(a.op == WEIGHT for a in p) for p in programs]  # per rank: B and W apart
        self.steps = [batched(list(p)) for p in programs]
        # Per rank and step: the rank's next communication batch after it, whose receives go out ahead.
        self.following = [following_batches(steps) for steps in self.steps]
        self.position, self.clock = [0] * pp, [0.0] * pp
        self.available: list[set] = [set() for _ in range(pp)]  # inputs present on each rank
        self.posted: dict[tuple, float] = {}  # (key, is_send) -> time posted
        self.in_flight, self.timeline = [0] * pp, Timeline(pp, vpp, [[] for _ in range(pp)], [0] * pp)

    def run(self) -> Timeline:
        while any(self.position[r] < len(self.steps[r]) for r in range(self.pp)):
            posted = len(self.posted)
            advanced = [self._advance(r) for r in range(self.pp)]
            if not any(advanced) and len(self.posted) == posted:
                stuck = [str(self.steps[r][self.position[r]][0]) for r in range(self.pp)
                         if self.position[r] < len(self.steps[r])]
                raise ScheduleError(f"deadlock: ranks wait at {', '.join(stuck)}")
        unreceived = [key for key, is_send in self.posted if is_send and (key, False) not in self.posted]
        if unreceived:
            raise ScheduleError(f"sent, never received: {unreceived[0]}")
        return self.timeline

    def _advance(self, rank: int) -> bool:
        if self.position[rank] >= len(self.steps[rank]):
            return False
        step = self.steps[rank][self.position[rank]]
        done = self._compute(rank, step[0]) if step[0].is_compute else self._transfer(rank, step)
        if done:
            self.position[rank] += 1
        return done

    def _compute(self, rank: int, a: Action) -> bool:
        stage = stage_of(a, self.pp, self.v_shape)
        needs = [(a.op, stage, a.microbatch)] if upstream(stage, a.op, self.num_stages) is not None else []
        if a.op in (BACKWARD, WEIGHT):  # its forward's activations, its B's stash
            needs.append(("done" if a.op == BACKWARD else "input gradient", stage, a.microbatch))
        missing = [n for n in needs if n not in self.available[rank]]
        if missing:
            raise ScheduleError(f"{a} runs before its input {missing[0]} is on rank {rank}")
        start = self.clock[rank]
        cost = self.cost(a)
        if a.op == BACKWARD and not self.splits[rank]:
            cost += self.cost(replace(a, op=WEIGHT))
        self.clock[rank] = start + cost
        self.timeline.spans[rank].append(Span(a, start, self.clock[rank]))
        consumer = downstream(stage, a.op, self.num_stages)
        if consumer is not None and stage_place(consumer, self.pp, self.v_shape)[0] == rank:  # a local hand-over
            self.available[rank].add((a.op, consumer, a.microbatch))
        if a.op == FORWARD:
            self.available[rank].add(("done", stage, a.microbatch))
        if a.op == BACKWARD:
            self.available[rank].add(("input gradient", stage, a.microbatch))
        # Activations live until the backward's last half: W where it is apart.
        frees = a.op == WEIGHT or (a.op == BACKWARD and not self.splits[rank])
        self.in_flight[rank] += 1 if a.op == FORWARD else -1 if frees else 0
        peak = self.timeline.peak_in_flight
        peak[rank] = max(peak[rank], self.in_flight[rank])
        return True

    def _transfer(self, rank: int, batch: list[Action]) -> bool:
        ops = self._operations(batch)
        if not self.sends_block:  # the runtime waits the previous batch's sends before posting
            if not self._wait(rank, self.unwaited[rank]):
                return False
            self.unwaited[rank] = []
        ahead = self._operations(self.following[rank][self.position[rank]]) if self.receives_ahead else []
        for op, _ in ops + [op for op in ahead if not op[0][1]]:
            self.posted.setdefault(op, self.clock[rank])
        waited = ops if self.sends_block else [op for op in ops if not op[0][1]]
        if not self._wait(rank, waited):
            return False
        if not self.sends_block:
            self.unwaited[rank] = [op for op in ops if op[0][1]]
        self.available[rank].update(k for (k, is_send), _ in ops if not is_send)
        return True

    def _operations(self, batch: list[Action]) -> list[tuple]:
        """((transfer key, is a send), action) of each of a batch's operations."""
        return [((transfer_key(a, self.pp, self.num_stages, self.v_shape), a.op.startswith("SEND")), a) for a in batch]

    def _wait(self, rank: int, ops: list[tuple]) -> bool:
        """Whether every op's counterpart is posted; if so the rank's clock moves to their completion."""
        if any((key, not is_send) not in self.posted for (key, is_send), _ in ops):
            return False
        finish = [max(self.posted[(k, s)], self.posted[(k, not s)]) + self.cost(a) for (k, s), a in ops]
        self.clock[rank] = max([self.clock[rank], *finish])
        return True


def simulate(programs, pp: int, vpp: int, cost: CostFn | None = None, sends_block: bool = True,
             receives_ahead: bool = False, v_shape: bool = False) -> Timeline:
    """Time every rank's program (stages placed in a V with `v_shape`: zbv's); raises ScheduleError on a
    deadlock or a missing input."""
    return _Simulation(programs, pp, vpp, cost or uniform_costs(), sends_block, receives_ahead, v_shape).run()


def timeline_figure(timeline: Timeline, title: str = ""):
    """A matplotlib figure of the timeline (the caller saves and closes it): one row per rank, one colour
    per microbatch; forwards light, backwards dark, weight gradients (W) between and hatched, chunks
    labelled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import to_rgb

    microbatches = 1 + max(s.action.microbatch for rank in timeline.spans for s in rank)
    palette = plt.get_cmap("tab20" if microbatches > 10 else "tab10")
    fig, ax = plt.subplots(figsize=(max(8.0, timeline.makespan * 0.35), 0.6 * timeline.pp + 1.2))
    for rank, spans in enumerate(timeline.spans):
        # One collection per rank and hatch: an artist per action makes drawing grow with their square.
        for hatched in (False, True):
            drawn = [s for s in spans if (s.action.op == WEIGHT) == hatched]
            colors = [tuple(c + (1 - c) * {FORWARD: 0.55, WEIGHT: 0.3}.get(s.action.op, 0.0)  # mixed with white
                            for c in to_rgb(palette(s.action.microbatch % palette.N))) for s in drawn]
            if drawn:
                ax.broken_barh([(s.start, s.end - s.start) for s in drawn], (rank - 0.4, 0.8), facecolors=colors,
                               edgecolors="black", linewidth=0.5, hatch="//" if hatched else None)
        for s in spans:
            label = f"{s.action.op}{s.action.microbatch}" + (f"c{s.action.chunk}" if timeline.vpp > 1 else "")
            ax.text((s.start + s.end) / 2, rank, label, ha="center", va="center", fontsize=6)
    ax.set_yticks(range(timeline.pp), [f"rank {r}" for r in range(timeline.pp)])
    ax.invert_yaxis()
    ax.set_xlabel("time (forward = 1)")
    ax.set_title(f"{title}  bubble {timeline.bubble_fraction:.1%}".strip())
    fig.tight_layout()
    return fig
