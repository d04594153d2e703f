"""A rank's memory over one optimizer step, by category, following the FSDP protocol unit by unit through
the rank's pipeline program: the peak of the categories `mem_snapshot_stop_step` measures, and the
buffers it does not see.

Each forward of a unit gathers it (and prefetches the next), saves its activations, and under
reshard_after_forward frees the gathered copy; each backward gathers it again (and prefetches the
previous one), frees its activations into its fp32 unsharded gradient accumulator, and on a microbatch
that reduces (the chunk's last; every one with grad_reduce=per_microbatch) hands the accumulator to the
reduce-scatter, whose result lands in the shard's gradient (or, per microbatch, an fp32 shard sum).
The optimizer's two Adam moments per shard element exist from the first update on: the step modelled
is a later one. Samples are taken where the CPU measurement takes them: as a unit's activations are
saved (forward), and as its backward starts (the unit and the previous one gathered, its accumulator
made beside its activations, the next one's gradient already handed to its reduction). Reductions
queue per chunk, as each chunk's FSDP root keeps its own queue.

Two buffers the snapshot does not see are followed at the moments they exist: the loss's scratch (its
forward's and backward's peaks over what it leaves saved) on the chunk holding the head, and under a
zero-bubble program (with W actions) each B's deferred weight-gradient operands, which its W frees; the
unit's reduction then starts in W, behind those GEMMs (parallel/fsdp/hooks.py).
"""

from collections import deque
from dataclasses import dataclass

from parallel.pipeline.schedule import BACKWARD, FORWARD, WEIGHT, Action

FP32 = 4


@dataclass(frozen=True)
class UnitPlan:
    numel: int  # TP-local parameters
    activation: int  # bytes one microbatch saves in it
    outside: int = 0  # saved after it (the loss), freed before its backward starts
    outside_forward: int = 0  # the loss forward's peak beyond `outside` (its scratch, the logits)
    outside_backward: int = 0  # the loss backward's peak beyond `outside`
    deferred: int = 0  # what its B leaves its W (zero-bubble programs): the weight-gradient GEMMs' operands


@dataclass(frozen=True)
class ShardingPlan:
    world: int  # the shard group: dp_shard x cp
    compute_bytes: int  # element size of the gathered parameters
    reshard_after_forward: bool
    per_microbatch: bool  # grad_reduce=per_microbatch
    collectives: int  # a reduction's collectives before it lands on the step's last microbatch ...
    collectives_before_last: int  # ... and on an earlier one (per microbatch)
    in_flight: int = 2  # reductions each chunk's queue keeps going before it completes the oldest
    aliases_shard: bool = False  # a one-rank group in fp32: the unsharded parameters are the shard itself
    fuses: bool = False  # gradient_accumulation_fusion (fp32): the GEMMs write the accumulator as they run
    cuts_views: bool = False  # optimize_backward_concat: before the last microbatch, gradients added as they come
    reduce_bytes: int = FP32  # element size of a reduction in flight: reduce_dtype (its fp32 gradient goes once cast)

    def shard(self, numel: int) -> int:
        return -(-numel // self.world)

    def padded(self, numel: int) -> int:
        return self.shard(numel) * self.world


class _Held:
    """A set of units holding a buffer each, with the bytes they hold together."""

    def __init__(self, nbytes):
        self.nbytes, self.units, self.total = nbytes, set(), 0

    def add(self, key: tuple[int, int]) -> None:
        if key not in self.units:
            self.units.add(key)
            self.total += self.nbytes(key)

    def discard(self, key: tuple[int, int]) -> None:
        if key in self.units:
            self.units.remove(key)
            self.total -= self.nbytes(key)


class _State:
    def __init__(self, chunks: list[list[UnitPlan]], plan: ShardingPlan):
        self.chunks, self.plan = chunks, plan
        numel = {(c, i): u.numel for c, chunk in enumerate(chunks) for i, u in enumerate(chunk)}
        shards = sum(plan.shard(n) for n in numel.values())
        self.gathered = _Held(lambda k: 0 if plan.aliases_shard else plan.compute_bytes * plan.padded(numel[k]))
        self.accumulators = _Held(lambda k: FP32 * plan.padded(numel[k]))
        self.shard_sums = _Held(lambda k: FP32 * plan.shard(numel[k]))
        self.shard_grads = _Held(lambda k: FP32 * plan.shard(numel[k]))
        # Each chunk's FSDP root has its own queue: [unit, collectives left, lands as the step's gradient]
        self.reductions: list[deque] = [deque() for _ in chunks]
        self.reducing = 0  # bytes of the unsharded gradients in reduction
        self.reducing_bytes = lambda k: plan.reduce_bytes * plan.padded(numel[k])
        self.fixed = {"parameter_shards": FP32 * shards, "optimizer_state": 2 * FP32 * shards}
        self.activations = 0
        self.deferred = 0  # the W operands of the Bs whose W has not run
        self.peak: dict = {"total": -1}
        self.measured: dict = {"total": -1}  # the peak of what the CPU snapshot counts

    def signature(self) -> tuple:
        """Everything the next actions' bytes depend on."""
        return (self.activations, self.deferred, self.reducing, frozenset(self.gathered.units),
                frozenset(self.accumulators.units), frozenset(self.shard_sums.units), frozenset(self.shard_grads.units),
                tuple(tuple(tuple(entry) for entry in queue) for queue in self.reductions))

    def run(self, op: str, chunk: int, last: bool, defers: bool) -> None:
        if op == FORWARD:
            self.forward(chunk)
        elif op == BACKWARD:
            self.backward(chunk, last, defers)
        else:
            self.weight(chunk, last)

    def unit(self, key: tuple[int, int]) -> UnitPlan:
        return self.chunks[key[0]][key[1]]

    def sample(self, loss_scratch: int = 0, parameter_grads: int = 0, snapshot: bool = True) -> None:
        """`snapshot`: a moment the CPU snapshot samples too (it samples as autograd saves or reads back a
        tensor, so not between a unit's last gradient and its hand-over)."""
        held = (self.fixed["parameter_shards"] + self.fixed["optimizer_state"] + self.gathered.total
                + self.accumulators.total + self.shard_sums.total + self.shard_grads.total + self.activations)
        total = held + self.reducing + self.deferred + loss_scratch + parameter_grads
        if total > self.peak["total"]:
            self.peak = {**self._categories(), "deferred_weight_grads": self.deferred, "loss_buffers": loss_scratch,
                         "parameter_gradients": parameter_grads, "total": total}
        if snapshot and held + self.reducing > self.measured["total"]:
            now = self._categories()
            self.measured = {"parameters": now["parameter_shards"] + now["unsharded_parameters"],
                             **{k: now[k] for k in ("gradients", "reducing_gradients", "optimizer_state", "activations")},
                             "total": held + self.reducing}

    def _categories(self) -> dict[str, int]:
        return {"parameter_shards": self.fixed["parameter_shards"], "unsharded_parameters": self.gathered.total,
                "gradients": self.accumulators.total + self.shard_sums.total + self.shard_grads.total,
                "reducing_gradients": self.reducing, "optimizer_state": self.fixed["optimizer_state"],
                "activations": self.activations}

    def gather(self, chunk: int, index: int) -> None:
        if 0 <= index < len(self.chunks[chunk]):
            self.gathered.add((chunk, index))

    def forward(self, chunk: int) -> None:
        for i, unit in enumerate(self.chunks[chunk]):
            self.gather(chunk, i)
            self.gather(chunk, i + 1)
            self.activations += unit.activation + unit.outside
            self.sample(unit.outside_forward)
            if self.plan.reshard_after_forward:
                self.gathered.discard((chunk, i))

    def backward(self, chunk: int, last: bool, defers: bool) -> None:
        """One B; `defers`: a W follows it, which takes its weight-gradient GEMMs and the reductions.

        Where the unit's gradients go while its activations are released: fused GEMMs (and, before the
        last microbatch, cut views) write the accumulator from the first weight gradient on, beside the
        activations. Connected views (the default) get the parameters' compute-dtype gradients from
        autograd, which holds each until the last arrives and then hands them over together into the
        accumulator; counted whole from the start, an upper bound."""
        for i in reversed(range(len(self.chunks[chunk]))):
            key, unit = (chunk, i), self.unit((chunk, i))
            if unit.outside:
                self.sample(unit.outside_backward)
            self.activations -= unit.outside
            self.gather(chunk, i)
            self.gather(chunk, i - 1)
            early = self.plan.fuses or (self.plan.cuts_views and not last)
            parameter_grads = 0 if early or defers else self.plan.compute_bytes * unit.numel
            if early and not defers:
                self.accumulators.add(key)
            self.sample(parameter_grads=parameter_grads)
            self.activations -= unit.activation
            self.accumulators.add(key)
            if parameter_grads:
                self.sample(parameter_grads=parameter_grads, snapshot=False)
            if defers:
                self.deferred += unit.deferred
            elif last or self.plan.per_microbatch:
                self.accumulators.discard(key)
                self.reduce(key, last)
            if self.plan.reshard_after_forward:
                self.gathered.discard(key)

    def weight(self, chunk: int, last: bool) -> None:
        """One W: its B's GEMMs run and free their operands, then each unit's reduction starts."""
        self.sample()
        for i in reversed(range(len(self.chunks[chunk]))):
            key = (chunk, i)
            self.deferred -= self.unit(key).deferred
            if last or self.plan.per_microbatch:
                self.accumulators.discard(key)
                self.reduce(key, last)

    def reduce(self, key: tuple[int, int], last: bool) -> None:
        """The unit's chunk's reduction queue (parallel/fsdp/reductions.py): pushing one moves every earlier
        one on by one collective, then starts it; beyond the limit the oldest completes. A completed one
        lands."""
        queue = self.reductions[key[0]]
        for entry in list(queue):
            entry[1] -= 1
            if entry[1] < 0:
                queue.remove(entry)
                self.complete(entry)
        collectives = self.plan.collectives if last else self.plan.collectives_before_last
        if collectives == 0:
            self.land(key, last)
        else:
            queue.append([key, collectives - 1, last])
            self.reducing += self.reducing_bytes(key)
        while len(queue) > self.plan.in_flight:
            self.complete(queue.popleft())

    def complete(self, entry: list) -> None:
        self.reducing -= self.reducing_bytes(entry[0])
        self.land(entry[0], entry[2])

    def land(self, key: tuple[int, int], last: bool) -> None:
        if last:
            self.shard_sums.discard(key)
            self.shard_grads.add(key)
        else:
            self.shard_sums.add(key)


def compute_steps(program: list[Action]) -> tuple[tuple[str, int, bool], ...]:
    """A rank's program as what its bytes depend on: each compute action's op, chunk and whether it is of
    the chunk's last microbatch."""
    last_backward = {a.chunk: a.microbatch for a in program if a.op == BACKWARD}
    return tuple((a.op, a.chunk, a.microbatch == last_backward.get(a.chunk)) for a in program if a.is_compute)


def peak_memory(steps: tuple[tuple[str, int, bool], ...], chunks: list[list[UnitPlan]],
                plan: ShardingPlan) -> tuple[dict, dict]:
    """The rank's bytes by category at the peak of their sum over one step of a program (compute_steps),
    and at the peak of what mem_snapshot_stop_step measures, in its categories.

    The whole program, without running its steady state over and over: what happens next depends only on
    the state and the steps to come, so once the state is one seen L steps ago and the last L steps come
    again, they leave it as it is and sample what they sampled: the repeats are skipped, exactly. (A state
    recurs at several distances, a steady state's period among them: each is tried, nearest first.)"""
    state = _State(chunks, plan)
    defers = any(op == WEIGHT for op, _, _ in steps)
    seen: dict[tuple, list[int]] = {}
    i = 0
    while i < len(steps):
        signature = state.signature()
        for earlier in reversed(seen.get(signature, [])):
            period = i - earlier
            if steps[i:i + period] == steps[earlier:i]:
                while steps[i:i + period] == steps[i - period:i]:
                    i += period
                break
        seen.setdefault(signature, []).append(i)
        if i < len(steps):
            state.run(*steps[i], defers)
            i += 1
    return state.peak, state.measured
