"""Every valid layout of a model, global batch and sequence length on N devices, those that fit the memory
budget ranked by predicted step time (scripts/plan.py).

The layouts: tp (within a node), cp, pp (an even split, or Megatron's adjusted first and last stages when
the layers do not divide), one or more virtual stages, dp_shard x dp_replicate (HSDP with one node per
shard group), microbatch size, layer_ckpt, reshard_after_forward and grad_reduce; sequence parallelism
whenever tp > 1. Each row is checked by the trainer's own rules (trainer/config/rules.py) as a run of it
would be: its real microbatch count and its switches. Memory is the dry run's model over the step's real
program on the worst pipeline stage; a structure (everything but the last three switches) whose most
frugal variant does not fit is dropped with all its variants.
"""

import dataclasses
from dataclasses import dataclass
from itertools import product

from parallel.errors import ConfigError
from parallel.mesh import ParallelDims
from planner.devices import DeviceProfile
from planner.rank_plan import stage_plan
from planner.step_time import StepTime, compute_lower_bound, predict
from trainer.config.rules import validate
from trainer.config.schema import TrainConfig, setting
from trainer.parallelize import DTYPES

LAYOUT_KEYS = ("model_parallel_size", "model.sequence_parallel", "context_parallel_size", "pipeline_parallel_size",
               "num_layers_per_virtual_pipeline_stage", "pipeline_first_stage_layers", "pipeline_last_stage_layers",
               "dp_replicate", "batch_size", "microbatch_size", "model.layer_ckpt", "reshard_after_forward",
               "grad_reduce", "compute_dtype")
MAX_CP, MAX_PP = 8, 16  # beyond these the exchanges and the bubble outweigh what they save
# The switches that trade time for memory, each listed fastest first (recompute, re-gathers, reductions
# per microbatch only add work): a variant is never faster than one at least as fast on every switch.
SWITCHES = (("none", "selective", "full"), (False, True), ("last_microbatch", "per_microbatch"))
VARIANTS = tuple(product(*SWITCHES))


@dataclass(frozen=True)
class Candidate:
    cfg: TrainConfig
    dims: ParallelDims
    peak_bytes: int
    time: StepTime | None = None

    def overrides(self) -> list[str]:
        return [setting(self.cfg, key) for key in LAYOUT_KEYS]


class NothingFits(ConfigError):
    """Every valid layout overflows the budget (the message names the closest)."""


def _powers_of_two(limit: int) -> list[int]:
    return [1 << i for i in range(limit.bit_length()) if 1 << i <= limit]


def _stage_splits(n_layers: int, pp: int) -> list[tuple[int | None, int | None, int | None]]:
    """(layers per virtual stage, first stage's, last stage's) splits over pp ranks."""
    if pp == 1:
        return [(None, None, None)]
    if n_layers % pp == 0:
        per = n_layers // pp
        return [(None, None, None), *((per // v, None, None) for v in (2, 4) if per % v == 0 and per // v >= 1)]
    each = -(-n_layers // pp)  # Megatron's uneven split: the middle stages take the ceiling, the ends the rest
    rest = n_layers - (pp - 2) * each
    return [(None, rest // 2, rest - rest // 2)] if rest >= 2 and pp > 2 else []


def structures(base: TrainConfig, world: int, global_batch: int, device: DeviceProfile):
    """(tp, cp, pp, split, dp_replicate, microbatch_size, batch_size) of every layout the sizes allow."""
    m = base.model
    for tp in _powers_of_two(min(device.gpus_per_node, world)):
        for cp in _powers_of_two(min(MAX_CP, world // tp)):
            if base.seq_len % (2 * cp) and cp > 1:
                continue
            for pp in (p for p in range(1, min(MAX_PP, m.n_layers, world // (tp * cp)) + 1) if world % (tp * cp * p) == 0):
                dp = world // (tp * cp * pp)
                if global_batch % dp:
                    continue
                batch = global_batch // dp
                replicas = {1} | {dp * tp * cp // device.gpus_per_node} if dp * tp * cp > device.gpus_per_node else {1}
                for split, replicate, micro in product(_stage_splits(m.n_layers, pp), sorted(replicas), (1, 2, 4)):
                    if batch % micro == 0 and dp % replicate == 0:
                        yield tp, cp, pp, split, replicate, micro, batch


def _configure(base: TrainConfig, structure: tuple, variant: tuple, dtype: str) -> TrainConfig:
    tp, cp, pp, (per_stage, first, last), replicate, micro, batch = structure
    ckpt, reshard, reduce = variant
    model = dataclasses.replace(base.model, sequence_parallel=tp > 1, layer_ckpt=ckpt)
    return dataclasses.replace(base, model=model, model_parallel_size=tp, context_parallel_size=cp,
                               pipeline_parallel_size=pp, num_layers_per_virtual_pipeline_stage=per_stage,
                               pipeline_first_stage_layers=first, pipeline_last_stage_layers=last,
                               dp_replicate=replicate, batch_size=batch, microbatch_size=micro,
                               reshard_after_forward=reshard, grad_reduce=reduce, compute_dtype=dtype,
                               dry_run=True, world_size=None)


def given_layout(base: TrainConfig, world: int, device: DeviceProfile) -> Candidate:
    """The overrides' own layout, checked and predicted as a row of the search is (compute_dtype as there)."""
    cfg = dataclasses.replace(base, compute_dtype=_dtype(base, device))
    dims = validate(cfg, world)
    return Candidate(cfg, dims, peak_bytes(cfg, dims), predict(cfg, dims, device, DTYPES[cfg.compute_dtype].itemsize))


def _dtype(base: TrainConfig, device: DeviceProfile) -> str:
    """compute_dtype as a run on the device resolves it (bf16 on a GPU, fp32 on a CPU) unless set."""
    return base.compute_dtype or ("fp32" if device.name == "cpu" else "bf16")


def peak_bytes(cfg: TrainConfig, dims: ParallelDims, above: int | None = None) -> int:
    """The worst pipeline rank's predicted peak over the step's real program, on every rank: the first
    holds the most microbatches and the last the loss in a loop, but uneven stages give the middle ranks
    more layers, and zbv's V puts both ends on rank 0 and two receives a batch on the middle ranks.
    With `above`, the first rank's peak past it is enough (the ends first): the layout does not fit."""
    peak = 0
    for rank in sorted(range(dims.pp), key=lambda r: r not in (0, dims.pp - 1)):
        peak = max(peak, stage_plan(cfg, dims, rank).memory["peak_bytes"])
        if above is not None and peak > above:
            break
    return peak


def _at_least_as_fast(a: tuple, b: tuple) -> bool:
    return all(options.index(x) <= options.index(y) for options, x, y in zip(SWITCHES, a, b))


class _Layouts:
    """Every (structure, variant) configured, and checked by the trainer's validate() as a run of it would
    be (its real microbatch count, its switches), once and only when asked: a long step's schedule takes
    seconds to build. A structure's layout comes from a cheaper check, on at most 2 x pp microbatches."""

    def __init__(self, base: TrainConfig, world: int, dtype: str):
        self.base, self.world, self.dtype = base, world, dtype
        self.checked: dict[tuple, ParallelDims | ConfigError] = {}

    def configure(self, structure: tuple, variant: tuple) -> TrainConfig:
        return _configure(self.base, structure, variant, self.dtype)

    def check(self, structure: tuple, variant: tuple, shortened: bool = False) -> ParallelDims | ConfigError:
        key = (structure, variant, shortened)
        if key not in self.checked:
            cfg = self.configure(structure, variant)
            if shortened:
                micro = min(cfg.num_microbatches, 2 * cfg.pipeline_parallel_size)
                cfg = dataclasses.replace(cfg, batch_size=micro * cfg.microbatch_size)
            try:
                self.checked[key] = validate(cfg, self.world)
            except ConfigError as refusal:
                self.checked[key] = refusal
        return self.checked[key]

    def dims(self, structure: tuple) -> ParallelDims | ConfigError:
        """The structure's layout, from its first variant the rules accept on the shortened step (the rules
        that read the microbatch count wait for check()); else the first refusal."""
        refusal = None
        for variant in VARIANTS:
            result = self.check(structure, variant, shortened=True)
            if isinstance(result, ParallelDims):
                return result
            refusal = refusal or result
        return refusal


def plan_layouts(base: TrainConfig, world: int, global_batch: int, device: DeviceProfile, budget_bytes: int,
                 top: int) -> list[Candidate]:
    """The `top` fastest fitting layouts, fastest first, each one the trainer's rules accept. Layouts are
    tried in the order of their compute alone (a bound no step beats), so the search stops once that bound
    passes the top rows' times. Raises ConfigError when no layout is valid, NothingFits when none fits."""
    dtype = _dtype(base, device)
    dtype_bytes = DTYPES[dtype].itemsize
    layouts, refusals = _Layouts(base, world, dtype), []
    queue = _queue(layouts, structures(base, world, global_batch, device), device, dtype_bytes, refusals)
    best: list[Candidate] = []
    # structure -> its fitting variants so far; None: its most frugal variant, a bound on every other (valid
    # or not), overflows
    fits: dict[tuple, list | None] = {}
    examined: set[tuple] = set()  # the structures with a valid variant whose memory was checked
    for bound, _, cfg, dims, structure, variant in queue:
        if len(best) >= top and bound >= best[-1].time.step_s:
            break
        fitting = fits.get(structure, [])
        if fitting is None or any(_at_least_as_fast(f, variant) for f in fitting):
            continue  # nothing of it fits, or a fitting variant of it is as fast on every switch
        if isinstance(checked := layouts.check(structure, variant), ConfigError):
            refusals.append(checked)  # checked first: a refused microbatch count may take long to schedule
            continue
        examined.add(structure)
        peak = peak_bytes(cfg, dims, above=budget_bytes)
        if peak > budget_bytes:
            if structure not in fits:  # does anything of it fit? Its most frugal variant says
                frugal = peak if variant == VARIANTS[-1] else peak_bytes(layouts.configure(structure, VARIANTS[-1]),
                                                                         dims, above=budget_bytes)
                fits[structure] = [] if frugal <= budget_bytes else None
            continue
        fits.setdefault(structure, []).append(variant)
        best.append(Candidate(cfg, dims, peak, predict(cfg, dims, device, dtype_bytes)))
        best = sorted(best, key=lambda c: c.time.step_s)[:top]
    if not examined:
        what = f"on {world} devices is valid: {refusals[0]}" if refusals else f"divides a world of {world} devices"
        raise ConfigError(f"no layout of model.n_layers={base.model.n_layers}, model.n_heads={base.model.n_heads}, "
                          f"seq_len={base.seq_len} and a global batch of {global_batch} sequences {what}")
    if not best:
        raise NothingFits(_closest(layouts, examined, budget_bytes))
    return best


def _queue(layouts: _Layouts, candidates, device: DeviceProfile, dtype_bytes: int, refusals: list) -> list[tuple]:
    """(compute bound, order, cfg, dims, structure, variant) of every variant of every structure the rules
    accept, by their bound."""
    queue = []
    for structure in candidates:
        dims = layouts.dims(structure)
        if isinstance(dims, ConfigError):
            refusals.append(dims)
            continue
        for variant in VARIANTS:
            cfg = layouts.configure(structure, variant)
            queue.append((compute_lower_bound(cfg, dims, device, dtype_bytes), len(queue), cfg, dims, structure, variant))
    return sorted(queue, key=lambda q: q[:2])


def _closest(layouts: _Layouts, examined: set[tuple], budget_bytes: int) -> str:
    """The message naming the valid layout that comes closest to the budget: the smallest of the valid
    variants of the structure whose most frugal variant's peak is the smallest."""
    structure = min(examined, key=lambda s: peak_bytes(layouts.configure(s, VARIANTS[-1]), layouts.dims(s)))
    dims = layouts.dims(structure)
    valid = [layouts.configure(structure, v) for v in VARIANTS if isinstance(layouts.check(structure, v), ParallelDims)]
    peak, cfg = min(((peak_bytes(cfg, dims), cfg) for cfg in valid), key=lambda pc: pc[0])
    gib = 2**30
    overrides = " ".join(Candidate(cfg, dims, peak).overrides())
    return (f"no layout fits {budget_bytes / gib:.1f} GiB per device: the closest needs {peak / gib:.1f} GiB "
            f"({(peak - budget_bytes) / gib:.1f} GiB over): {overrides}")
