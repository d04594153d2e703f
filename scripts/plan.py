"""Rank every valid layout of a run on N devices by predicted step time, within a memory budget.

    python scripts/plan.py [hydra overrides] --world N [--gpus-per-node G] [--device h100] [--mem-gib X]
                           [--top K] [--json] [--global-batch B] [--as-given]

The overrides fix the model, seq_len and anything else the layouts share (as train.py composes them).
The global batch (sequences per step) is kept across layouts: --global-batch, else batch_size times the
data-parallel size the overrides' own layout has on N devices. Layouts that do not fit are dropped (with
none fitting, the closest and its overflow are named). Each row is the override list that launches it
on N devices (torchrun's world): the overrides given, less the layout keys the row sets, then the row's
own. --as-given ranks nothing: it checks and predicts the overrides' own layout (a published one, say).
The device profile is conf/device/<name>.yaml (cpu: measured now). A bad override, an unknown device or
a world no layout divides is one `error:` line, exit code 2. See docs/planning.md.
"""

import sys
from pathlib import Path

# Scripts run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
from collections.abc import Callable  # noqa: E402

from parallel.errors import ConfigError  # noqa: E402
from parallel.mesh import ParallelDims  # noqa: E402
from planner.config import compose_config  # noqa: E402
from planner.devices import load_device  # noqa: E402
from planner.search import LAYOUT_KEYS, Candidate, given_layout, plan_layouts  # noqa: E402
from scripts.launch_command import override_key  # noqa: E402

GIB = 2**30


def positive(kind: type) -> Callable[[str], int | float]:
    """argparse type: a finite number above 0."""
    def parse_value(text: str) -> int | float:
        value = kind(text)
        if not (math.isfinite(value) and value > 0):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
        return value
    return parse_value


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=positive(int), required=True, help="devices (ranks) of the run")
    parser.add_argument("--gpus-per-node", type=positive(int), help="devices per node (default: the profile's)")
    parser.add_argument("--device", default="h100", help="profile in conf/device/ (default h100)")
    parser.add_argument("--mem-gib", type=positive(float),
                        help="memory budget per device, GiB (default: the profile's memory less a reserve)")
    parser.add_argument("--top", type=positive(int), default=5, help="rows to show (default 5)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--global-batch", type=positive(int), help="sequences per optimizer step, kept across layouts")
    parser.add_argument("--as-given", action="store_true", help="predict the overrides' own layout only")
    return parser.parse_known_args(argv)


def launch_overrides(given: list[str], c: Candidate) -> list[str]:
    """The overrides that launch the row: those given, less what the row sets (and the dry run's keys, which
    would plan instead of train), then the row's layout."""
    replaced = {*LAYOUT_KEYS, "dry_run", "world_size"}
    kept = [o for o in given if override_key(o) not in replaced]
    return [*kept, *c.overrides()]


def row(given: list[str], c: Candidate) -> dict:
    return {"overrides": launch_overrides(given, c), "peak_gib": round(c.peak_bytes / GIB, 2), "step_s": c.time.step_s,
            "tokens_per_s_per_device": c.time.tokens_per_s_per_device, "mfu": c.time.mfu, "bound": c.time.bound}


def main(argv: list[str]) -> int:
    args, overrides = parse(argv)
    try:
        device = load_device(args.device)
        if args.gpus_per_node is not None:
            device = dataclasses.replace(device, gpus_per_node=args.gpus_per_node)
        if args.as_given and args.global_batch is not None:  # the given layout's batch_size sets its own
            raise ConfigError("--global-batch does not combine with --as-given (set batch_size in the overrides)")
        base = compose_config(overrides)
        global_batch = args.global_batch
        if global_batch is None:
            dims = ParallelDims.from_sizes(args.world, base.model_parallel_size, base.pipeline_parallel_size,
                                           base.context_parallel_size, base.dp_replicate)
            global_batch = base.batch_size * dims.dp
        budget = args.mem_gib * GIB if args.mem_gib is not None else device.budget_bytes
        found = ([given_layout(base, args.world, device)] if args.as_given
                 else plan_layouts(base, args.world, global_batch, device, int(budget), args.top))
        rows = [row(overrides, c) for c in found]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{args.world} x {device.name}, {budget / GIB:.1f} GiB each, global batch {global_batch} x seq_len "
          f"{base.seq_len}: {'the layout given' if args.as_given else 'fastest first'}")
    for i, r in enumerate(rows, 1):
        over = " (over the budget)" if r["peak_gib"] * GIB > budget else ""
        print(f"{i}. {r['step_s']:.3f} s/step  {r['tokens_per_s_per_device']:.0f} tok/s/device  MFU {r['mfu']:.1%}  "
              f"peak {r['peak_gib']:.1f} GiB{over}  bound: {r['bound']}\n   {' '.join(r['overrides'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
