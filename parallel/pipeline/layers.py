"""Which layers each pipeline stage runs, and which rank and chunk hold each stage.

Stages are placed in a loop: virtual stage s = chunk c x pp + rank r. The V-shaped zero-bubble schedule
(zbv, two chunks per rank) places them in a V instead: rank r holds stage r (chunk 0) and stage
2pp - 1 - r (chunk 1), so the first and the last stage both sit on rank 0 and the hand-over at the V's
turn stays on rank pp - 1. Each stage holds a contiguous block of layers, in stage order. By default
every stage holds the same count. `first` and `last` (Megatron's decoder_first/last_pipeline_num_layers)
give stage 0 (chunk 0 of rank 0) and the last stage (the last chunk of the last rank; in a V, chunk 1 of
rank 0) their own counts: those stages also run the embedding and the output head. The other stages
split the rest evenly.
Layer indices stay those of the whole model, so any split loads a checkpoint of any other.
"""

from parallel.errors import ConfigError

FIRST_KEY, LAST_KEY = "pipeline_first_stage_layers", "pipeline_last_stage_layers"


def _set_ends(stages: int, first: int | None, last: int | None) -> dict[int, int]:
    """The stages given their own count: {stage: layers}."""
    ends = {s: n for s, n in ((0, first), (stages - 1, last)) if n is not None}
    if ends and stages < 2:
        raise ConfigError(f"{FIRST_KEY} and {LAST_KEY} need at least 2 pipeline stages "
                          "(pipeline_parallel_size x virtual stages), got 1")
    return ends


def _describe(n_layers: int, first: int | None, last: int | None) -> str:
    keys = [f"{key}={n}" for key, n in ((FIRST_KEY, first), (LAST_KEY, last)) if n is not None]
    return f"model.n_layers={n_layers} with {' and '.join(keys)}" if keys else f"model.n_layers={n_layers}"


def stage_layer_counts(n_layers: int, pp: int, vpp: int, first: int | None = None,
                       last: int | None = None) -> tuple[int, ...]:
    """Layers of each virtual stage, in stage order; ConfigError (one line) when they do not split."""
    stages = pp * vpp
    ends = _set_ends(stages, first, last)
    others, rest = stages - len(ends), n_layers - sum(ends.values())
    even = others > 0 and rest >= others and rest % others == 0
    if min(ends.values(), default=1) < 1 or not (even or others == rest == 0):
        raise ConfigError(
            f"{_describe(n_layers, first, last)} does not split over pipeline_parallel_size={pp} x {vpp} "
            f"virtual stages: the other {others} stages would share {rest} layers; every stage needs the same "
            "count of at least one layer"
        )
    return tuple(ends.get(s, rest // others if others else 0) for s in range(stages))


def virtual_stages(n_layers: int, pp: int, per_stage: int | None, first: int | None = None,
                   last: int | None = None) -> int:
    """Chunks per rank when every stage but the adjusted first and last holds `per_stage` layers
    (num_layers_per_virtual_pipeline_stage; None: one chunk). Floors: check_virtual_split refuses the rest."""
    if per_stage is None:
        return 1
    ends = [n for n in (first, last) if n is not None]
    return ((n_layers - sum(ends)) // per_stage + len(ends)) // pp


def check_virtual_split(n_layers: int, pp: int, per_stage: int, first: int | None = None,
                        last: int | None = None) -> None:
    """The stages of `per_stage` layers plus the adjusted ends must fill whole chunks on every rank."""
    ends = [n for n in (first, last) if n is not None]
    rest = n_layers - sum(ends)
    stages = rest // per_stage + len(ends) if rest >= 0 else 0
    if per_stage and rest == 0:
        raise ConfigError(
            f"{_describe(n_layers, first, last)} leaves no layer for stages of num_layers_per_virtual_pipeline_stage"
            f"={per_stage}: it would size no stage; unset it"
        )
    if rest < 0 or rest % per_stage or stages % pp or stages == 0:
        raise ConfigError(
            f"{_describe(n_layers, first, last)} leaves {rest} layers for stages of num_layers_per_virtual_pipeline_stage"
            f"={per_stage}: they must fill whole stages, and all stages a multiple of pipeline_parallel_size={pp}"
        )


def stage_index(pp: int, rank: int, chunk: int, v_shape: bool = False) -> int:
    """The virtual stage that chunk `chunk` of rank `rank` runs."""
    if v_shape:
        return rank if chunk == 0 else 2 * pp - 1 - rank
    return chunk * pp + rank


def rank_stages(pp: int, vpp: int, rank: int, v_shape: bool = False) -> list[int]:
    """The virtual stages of a rank's chunks, in chunk order (increasing, in a loop and in a V)."""
    return [stage_index(pp, rank, chunk, v_shape) for chunk in range(vpp)]


def stage_place(stage: int, pp: int, v_shape: bool = False) -> tuple[int, int]:
    """(rank, chunk) that run a virtual stage: stage_index's inverse."""
    if v_shape:
        return (stage, 0) if stage < pp else (2 * pp - 1 - stage, 1)
    return stage % pp, stage // pp


def chunk_layers(n_layers: int, pp: int, vpp: int, rank: int, chunk: int, first: int | None = None,
                 last: int | None = None, v_shape: bool = False) -> range:
    """The global layer indices of chunk `chunk` of rank `rank` (its virtual stage by stage_index)."""
    counts = stage_layer_counts(n_layers, pp, vpp, first, last)
    stage = stage_index(pp, rank, chunk, v_shape)
    start = sum(counts[:stage])
    return range(start, start + counts[stage])
