"""Draw a pipeline schedule as a timeline PNG and print its bubble and memory; no GPU, no process group.

    python scripts/visualize_schedule.py pp=4 vpp=2 microbatches=8 schedule=interleaved_1f1b out.png

Optional: forward=1 backward=2 p2p=0 (per-action costs, in forwards of one chunk; weight=N: the part of
a backward that is its weight gradients, W in zb_h1 and zbv, half by default), sends=block|async|ahead
(block: a send waits for its receive, the strict model; async: as the runtime on NCCL, a send is waited
at the next batch; ahead: as the runtime on gloo, receives also posted a batch ahead) and actions=FILE (write every rank's action list, one action per line, e.g.
`r1 F c0 m3`, to diff two schedules).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.errors import ConfigError  # noqa: E402
from parallel.pipeline.schedule import (  # noqa: E402
    BACKWARD, FORWARD, WEIGHT, Action, effective_schedule, pipeline_actions, v_shaped,
)
from parallel.pipeline.simulate import draw_timeline, simulate, uniform_costs  # noqa: E402

DEFAULTS = {"pp": "4", "vpp": "1", "microbatches": "8", "schedule": "1f1b", "forward": "1", "backward": "2", "p2p": "0",
            "weight": "", "sends": "block", "actions": ""}
USAGE = "usage: visualize_schedule.py [pp=N] [vpp=N] [microbatches=N] [schedule=gpipe|1f1b|interleaved_1f1b|zb_h1|zbv] OUT.png"


def parse(argv: list[str]) -> tuple[dict[str, str], str]:
    options, outputs = dict(DEFAULTS), []
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            outputs.append(arg)
        elif key in options:
            options[key] = value
        else:
            raise SystemExit(f"error: unknown option {key!r}\n{USAGE}")
    if len(outputs) != 1:
        raise SystemExit(USAGE)
    return options, outputs[0]


def main(argv: list[str]) -> None:
    options, out = parse(argv)
    try:
        pp, vpp, m = int(options["pp"]), int(options["vpp"]), int(options["microbatches"])
        weight = float(options["weight"]) if options["weight"] else None
        costs = uniform_costs(float(options["forward"]), float(options["backward"]), float(options["p2p"]), weight)
        programs = pipeline_actions(options["schedule"], pp, vpp, m)
        if options["sends"] not in ("block", "async", "ahead"):
            raise ValueError(f"sends={options['sends']} is not one of: block | async | ahead")
    except (ConfigError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    timeline = simulate(programs, pp, vpp, costs, sends_block=options["sends"] == "block",
                        receives_ahead=options["sends"] == "ahead", v_shape=v_shaped(options["schedule"]))
    title = f"{effective_schedule(options['schedule'], vpp)}  pp={pp} vpp={vpp} microbatches={m}"
    draw_timeline(timeline, out, title)
    if options["actions"]:
        Path(options["actions"]).write_text("".join(f"{a}\n" for program in programs for a in program))
    peak = ", ".join(f"{p:g}" for p in timeline.peak_microbatches)
    analytic = analytic_bubble(options["schedule"], pp, vpp, m, costs)
    print(f"{title}: makespan {timeline.makespan:g}, bubble {timeline.bubble_fraction:.1%} "
          f"(analytic {'-' if analytic is None else f'{analytic:.1%}'}), "
          f"peak activations per rank (microbatches) [{peak}] -> {out}")


def analytic_bubble(schedule: str, pp: int, vpp: int, m: int, costs) -> float | None:
    """(pp - 1) / (vpp m + pp - 1); for zb_h1 the paper's (pp - 1) / (3m + pp - 1), and for zbv, from
    2pp - 1 microbatches, (pp - 1) / (6m + pp - 1) (half a stage per chunk): both assume that F, B and W
    cost the same (None otherwise)."""
    if schedule not in ("zb_h1", "zbv"):
        return (pp - 1) / (vpp * m + pp - 1)
    if len({costs(Action(0, op, 0, 0)) for op in (FORWARD, BACKWARD, WEIGHT)}) > 1:
        return None
    if schedule == "zbv":
        return (pp - 1) / (6 * m + pp - 1) if m >= 2 * pp - 1 else None
    return (pp - 1) / (3 * m + pp - 1)

if __name__ == "__main__":
    main(sys.argv[1:])
