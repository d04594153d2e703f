"""Every valid layout of a model, global batch and sequence length on N devices, those that fit the memory
budget ranked by predicted step time (scripts/plan.py).

The layouts: tp (within a node), cp, pp (an even split, or Megatron's adjusted first and last stages when
the layers do not divide), one or more virtual stages, dp_shard x dp_replicate (HSDP with one node per
shard group), microbatch size, layer_ckpt, reshard_after_forward and grad_reduce; sequence parallelism
whenever tp > 1. Each is checked by the trainer's own rules (trainer/config/rules.py). Memory is the dry
run's model on the worst pipeline stage; a structure (everything but the last three switches) whose most
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


def shortened(cfg: TrainConfig, pp: int) -> TrainConfig:
    """The layout with at most 2 x pp microbatches: past them a stage's peak memory no longer grows (1F1B
    holds at most pp in flight; the gradient buffers exist from the first backward), and the step time
    is extrapolated from them (step_time.py)."""
    micro = min(cfg.num_microbatches, 2 * pp)
    return dataclasses.replace(cfg, batch_size=micro * cfg.microbatch_size)


def peak_bytes(cfg: TrainConfig, dims: ParallelDims) -> int:
    """The worst pipeline rank's predicted peak, over every rank: the first holds the most microbatches
    and the last the loss in a loop, but uneven stages give the middle ranks more layers, and zbv's V
    puts both ends on rank 0 and two receives a batch on the middle ranks."""
    return max(stage_plan(cfg, dims, r).memory["peak_bytes"] for r in range(dims.pp))


def _at_least_as_fast(a: tuple, b: tuple) -> bool:
    return all(options.index(x) <= options.index(y) for options, x, y in zip(SWITCHES, a, b))


def plan_layouts(base: TrainConfig, world: int, global_batch: int, device: DeviceProfile, budget_bytes: int,
                 top: int) -> list[Candidate]:
    """The `top` fastest fitting layouts, fastest first. Layouts are tried in the order of their compute
    alone (a bound no step beats), so the search stops once that bound passes the top rows' times.
    Raises ConfigError when no layout is valid, NothingFits when none fits."""
    dtype = base.compute_dtype or ("fp32" if device.name == "cpu" else "bf16")
    dtype_bytes = DTYPES[dtype].itemsize
    queue = []
    for structure in structures(base, world, global_batch, device):
        try:  # the shortened step: the rules that read the microbatch count hold for more of them
            dims = validate(shortened(_configure(base, structure, VARIANTS[-1], dtype), structure[2]), world)
        except ConfigError:
            continue
        for variant in VARIANTS:
            cfg = _configure(base, structure, variant, dtype)
            queue.append((compute_lower_bound(cfg, dims, device, dtype_bytes), len(queue), cfg, dims, structure, variant))
    valid = bool(queue)
    best: list[Candidate] = []
    closest: Candidate | None = None
    fits: dict[tuple, list] = {}  # structure -> its fitting variants so far (None: its most frugal overflows)
    for bound, _, cfg, dims, structure, variant in sorted(queue, key=lambda q: q[:2]):
        if len(best) >= top and bound >= best[-1].time.step_s:
            break
        if structure not in fits:
            frugal = _configure(base, structure, VARIANTS[-1], dtype)
            peak = peak_bytes(shortened(frugal, dims.pp), dims)
            fits[structure] = [] if peak <= budget_bytes else None
            if fits[structure] is None and (closest is None or peak < closest.peak_bytes):
                closest = Candidate(frugal, dims, peak)
        if fits[structure] is None or any(_at_least_as_fast(f, variant) for f in fits[structure]):
            continue  # nothing of it fits, or a fitting variant of it is as fast on every switch
        peak = peak_bytes(shortened(cfg, dims.pp), dims)
        if peak > budget_bytes:
            continue
        fits[structure].append(variant)
        best.append(Candidate(cfg, dims, peak, predict(cfg, dims, device, dtype_bytes)))
        best = sorted(best, key=lambda c: c.time.step_s)[:top]
    fitting = best
    if not valid:
        raise ConfigError(f"no layout of model.n_layers={base.model.n_layers}, model.n_heads={base.model.n_heads}, "
                          f"seq_len={base.seq_len} and a global batch of {global_batch} sequences divides a world "
                          f"of {world} devices")
    if not fitting:
        gib = 2**30
        raise NothingFits(f"no layout fits {budget_bytes / gib:.1f} GiB per device: the closest needs "
                          f"{closest.peak_bytes / gib:.1f} GiB ({(closest.peak_bytes - budget_bytes) / gib:.1f} GiB "
                          f"over): {' '.join(closest.overrides())}")
    return fitting
