"""Draw a pipeline schedule as a timeline PNG and print its bubble and memory; no GPU, no process group.

    python scripts/visualize_schedule.py pp=4 vpp=2 microbatches=8 schedule=interleaved_1f1b out.png

Optional: forward=1 backward=2 p2p=0 (per-action costs, in forwards of one chunk; weight=N: the part of
a backward that is its weight gradients, W in zb_h1 and zbv, half by default), sends=block|async|ahead
(block: a send waits for its receive, the strict model; async: as the runtime on NCCL, a send is waited
at the next batch; ahead: as the runtime on gloo, receives also posted a batch ahead) and actions=FILE (write every rank's action list, one action per line, e.g.
`r1 F c0 m3`, to diff two schedules). OUT's extension picks the image format (.png, .pdf, .svg, ...).

Bounds, past which the picture takes minutes or gigabytes: pp <= 64, pp x vpp x microbatches <= 1024 and
a makespan of at most 2048 (in the costs' unit, 0.35 in of picture each).
"""

import math
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.errors import ConfigError  # noqa: E402
from parallel.pipeline.schedule import (  # noqa: E402
    BACKWARD, FORWARD, WEIGHT, Action, effective_schedule, pipeline_actions, splits_backward, v_shaped,
)
from parallel.pipeline.simulate import CostFn, Timeline, simulate, timeline_figure, uniform_costs  # noqa: E402
from scripts.image_output import file_problem, image_problem, save_figure, write_atomically  # noqa: E402

DEFAULTS = {"pp": "4", "vpp": "1", "microbatches": "8", "schedule": "1f1b", "forward": "1", "backward": "2", "p2p": "0",
            "weight": "", "sends": "block", "actions": ""}
USAGE = "usage: visualize_schedule.py [pp=N] [vpp=N] [microbatches=N] [schedule=gpipe|1f1b|interleaved_1f1b|zb_h1|zbv] OUT.png"
MAX_PP = 64  # rows of the picture
# matplotlib re-fits its axes at each span it adds: drawing time grows with the square of the spans (2 or 3
# per stage and microbatch), about 10 s at this bound.
MAX_STAGE_MICROBATCHES = 1024
MAX_MAKESPAN = 2048  # the picture's width, 0.35 in (42 pixels) per unit of time


def parse(argv: list[str]) -> tuple[dict[str, str], str]:
    options, outputs = dict(DEFAULTS), []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            outputs.append(arg)
        elif key in options:
            options[key] = value
        else:
            raise ConfigError(f"unknown option {key}= (options: {', '.join(DEFAULTS)}); {USAGE}")
    if len(outputs) != 1:
        given = f": {' '.join(outputs)}" if outputs else ""
        raise ConfigError(f"one output image expected, got {len(outputs)}{given}; {USAGE}")
    return options, outputs[0]


def count(options: dict[str, str], key: str, most: float = math.inf) -> int:
    try:
        value = int(options[key])
    except ValueError:
        value = 0
    if not 1 <= value <= most:
        bound = f"from 1 to {most}" if most < math.inf else ">= 1"
        raise ConfigError(f"{key}={options[key]}: must be an integer {bound}")
    return value


def cost(options: dict[str, str], key: str, zero_allowed: bool) -> float:
    """A finite cost; forward (the time unit) and backward more than 0."""
    try:
        value = float(options[key])
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero_allowed):
        raise ConfigError(f"{key}={options[key]}: must be a finite number {'>=' if zero_allowed else '>'} 0")
    return value


def layout(options: dict[str, str]) -> tuple[int, int, int]:
    """pp, vpp, microbatches, within the bounds a picture is drawn in seconds."""
    pp, vpp, m = count(options, "pp", MAX_PP), count(options, "vpp"), count(options, "microbatches")
    if pp * vpp * m > MAX_STAGE_MICROBATCHES:
        raise ConfigError(f"pp={pp} vpp={vpp} microbatches={m}: pp x vpp x microbatches must be at most "
                          f"{MAX_STAGE_MICROBATCHES} (the drawing time grows with its square), got {pp * vpp * m}")
    return pp, vpp, m


def costs_of(options: dict[str, str]) -> CostFn:
    """The per-action costs, each checked; W's no more than the whole backward."""
    forward, backward = cost(options, "forward", zero_allowed=False), cost(options, "backward", zero_allowed=False)
    p2p = cost(options, "p2p", zero_allowed=True)
    if options["weight"] and not splits_backward(options["schedule"]):
        raise ConfigError(f"weight={options['weight']}: W's share of the backward, which only zb_h1 and zbv run apart "
                          f"(schedule={options['schedule']} runs each backward whole)")
    weight = cost(options, "weight", zero_allowed=True) if options["weight"] else None
    if weight is not None and weight > backward:
        raise ConfigError(f"weight={options['weight']}: must be from 0 to backward={backward:g} (W is part of the "
                          "backward)")
    return uniform_costs(forward, backward, p2p, weight)


def check_outputs(out: str, actions: str) -> None:
    """Every output, before any is written."""
    problem = image_problem(out)
    if problem:
        raise ConfigError(f"output {out}: {problem}")
    problem = actions and file_problem(actions)
    if problem:
        raise ConfigError(f"actions={actions}: {problem}")
    if actions and Path(actions).resolve() == Path(out).resolve():
        raise ConfigError(f"actions={actions}: is the output image too; name another file")
    if actions and Path(actions).is_file() and not _is_action_list(Path(actions)):
        raise ConfigError(f"actions={actions}: exists and is not an action list this script wrote: name a new file")


def _is_action_list(path: Path) -> bool:
    """A file this script wrote (its first line an action, as `r0 F c0 m0`), which it may replace; or empty."""
    with path.open("rb") as f:
        first = f.readline(200)
    return not first or re.fullmatch(rb"r\d+ [A-Z_]+ c\d+ m\d+( (->|<-) r\d+)?\n", first) is not None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    try:
        options, out = parse(argv)
        pp, vpp, m = layout(options)
        costs = costs_of(options)
        if options["sends"] not in ("block", "async", "ahead"):
            raise ConfigError(f"sends={options['sends']} is not one of: block | async | ahead")
        check_outputs(out, options["actions"])
        timeline, programs = run(options, pp, vpp, m, costs)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    title = f"{effective_schedule(options['schedule'], vpp)}  pp={pp} vpp={vpp} microbatches={m}"
    try:
        save_figure(timeline_figure(timeline, title), out)
        if options["actions"]:
            listed = "".join(f"{a}\n" for program in programs for a in program)
            write_atomically(options["actions"], lambda partial: Path(partial).write_text(listed))
    except (OSError, ValueError) as e:  # what the checks cannot foresee, such as a full disk
        print(f"error: writing the outputs: {e}", file=sys.stderr)
        return 2
    peak = ", ".join(f"{p:g}" for p in timeline.peak_microbatches)
    analytic = analytic_bubble(options["schedule"], pp, vpp, m, costs)
    print(f"{title}: makespan {timeline.makespan:g}, bubble {timeline.bubble_fraction:.1%} "
          f"(analytic {'-' if analytic is None else f'{analytic:.1%}'}), "
          f"peak activations per rank (microbatches) [{peak}] -> {out}")
    return 0


def run(options: dict[str, str], pp: int, vpp: int, m: int, costs: CostFn) -> tuple[Timeline, tuple]:
    """The simulated timeline (cheap, unlike its picture) and every rank's program."""
    try:
        programs = pipeline_actions(options["schedule"], pp, vpp, m)
    except ConfigError as e:  # its wording names the trainer's keys: say which arguments they are here
        raise ConfigError(f"schedule={options['schedule']} pp={pp} vpp={vpp} microbatches={m}: {e}") from None
    timeline = simulate(programs, pp, vpp, costs, sends_block=options["sends"] == "block",
                        receives_ahead=options["sends"] == "ahead", v_shape=v_shaped(options["schedule"]))
    if timeline.makespan > MAX_MAKESPAN:
        raise ConfigError(f"forward={options['forward']} backward={options['backward']} p2p={options['p2p']} "
                          f"microbatches={m}: the makespan must be at most {MAX_MAKESPAN} to draw (0.35 in each), got "
                          f"{timeline.makespan:g}: give the costs in forwards (forward=1), or fewer microbatches")
    return timeline, programs


def analytic_bubble(schedule: str, pp: int, vpp: int, m: int, costs) -> float | None:
    """The formula's bubble, at free p2p and with transfers that never delay compute (a bound the simulated
    order meets where it can): (pp - 1) / (vpp m + pp - 1); for zb_h1 the paper's (pp - 1) / (3m + pp - 1),
    from pp microbatches, and for zbv, from 2pp - 1 microbatches, (pp - 1) / (6m + pp - 1) (half a stage
    per chunk): both with F, B and W costing the same. None where no formula applies."""
    if not splits_backward(schedule):
        return (pp - 1) / (vpp * m + pp - 1)
    if len({costs(Action(0, op, 0, 0)) for op in (FORWARD, BACKWARD, WEIGHT)}) > 1:
        return None
    if schedule == "zbv":
        return (pp - 1) / (6 * m + pp - 1) if m >= 2 * pp - 1 else None
    return (pp - 1) / (3 * m + pp - 1) if m >= pp else None


if __name__ == "__main__":
    sys.exit(main())
