"""Compare two runs step by step: losses, grad norms and eval losses, in ulps (of float32 where both
values are float32s, as grad norms are; else of float64) and relative terms, with
one verdict.

    python scripts/compare_runs.py DUMP_A DUMP_B [--rtol R] [--fields loss,grad_norm] [--plot out.png] [--brief]

Reads `metrics.jsonl` of both dump_dirs (a path to the file itself names its folder); eval losses only
where a run evaluated. Exit code 0 when every common step's loss, grad norm and eval
loss (or the --fields given) agree within --rtol (default 0: bit for bit), both runs logged the same
steps and fields, and their per-unit norms agree where both logged them (metrics.unit_norms=true), 1
otherwise, 2 when there is no verdict to trust (unreadable metrics, one metrics file given twice or
copied, no step in common, no value to compare, every value non-finite in both runs). A non-finite
value (logged as null) agrees only with a non-finite value at the same step (the verdict counts them); a field one run logged and the other did not is a difference. A partial last
line (a run still writing, or killed mid-line) is left out with a note. Notes on stderr name what the
verdict cannot see: a run that logged fewer steps than its config's `steps`, the config keys in which
the runs differ (from train_config.json), or that they differ in none, and keys that differ but change
nothing on either run's layout (from layout.json), so that the comparison does not test them.
Per-unit norms that differ (or that only one run logged) make the verdict a difference: the weights or
gradients differ, whatever the summed values show. --plot draws both loss curves
and their difference; --brief prints only the verdict line with each run's median TFLOP/s (for scripts such as
numerics_matrix.sh).
"""

import argparse
import json
import math
import os
import statistics
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.image_output import image_problem, save_figure  # noqa: E402
from scripts.metrics_file import (ABSENT, UnreadableMetrics, check_number, is_finite_number,  # noqa: E402
                                  read_metrics, run_folder)

FIELDS = ("loss", "grad_norm", "eval_loss")


def config_notes(dump_a: Path, dump_b: Path, a: dict[int, dict], b: dict[int, dict]) -> list[str]:
    """What the verdict cannot see: unfinished runs and the config keys the runs differ in."""
    configs = [_flat_config(d) for d in (dump_a, dump_b)]
    notes = [f"{d}: logged up to step {max(r)} of its steps={c['steps']} (unfinished, or still running)"
             for d, r, c in zip((dump_a, dump_b), (a, b), configs) if isinstance(c.get("steps"), int) and max(r) < c["steps"]]
    notes += [f"{d} has no readable train_config.json: the configs are not compared"
              for d, c in zip((dump_a, dump_b), configs) if not c]
    if all(configs):
        keys = [k for k in sorted(configs[0].keys() | configs[1].keys())
                if k != "dump_dir" and configs[0].get(k) != configs[1].get(k)]
        differ = [f"{k} ({configs[0].get(k)!r} vs {configs[1].get(k)!r})" for k in keys]
        if differ:
            notes.append("the configs differ in: " + ", ".join(differ) + _global_batch_note(dump_a, dump_b, configs))
        else:
            notes.append("the configs are identical (dump_dir aside): nothing was toggled between the runs")
        inert = [_inert_keys(dump_a), _inert_keys(dump_b)]
        notes += [f"{k} differs, but changes nothing on either run's layout (it needs {inert[0][k]}): "
                  "this comparison does not test it" for k in keys if k in inert[0] and k in inert[1]]
    return notes


def _inert_keys(dump_dir: Path) -> dict[str, str]:
    """{key: what it needs} of the keys that change nothing on the run's layout (layout.json)."""
    try:
        inert = json.loads((dump_dir / "layout.json").read_text()).get("inert_keys")
    except (OSError, ValueError, AttributeError):
        return {}
    return inert if isinstance(inert, dict) else {}


def _global_batch_note(dump_a: Path, dump_b: Path, configs: list[dict]) -> str:
    """batch_size is per data-parallel rank: two layouts of one global batch differ in it. Said where the
    runs' fingerprints (global_batch_size) show it."""
    if configs[0].get("batch_size") == configs[1].get("batch_size"):
        return ""
    sizes = []
    for dump in (dump_a, dump_b):
        try:
            sizes.append(json.loads((dump / "fingerprint.json").read_text()).get("global_batch_size"))
        except (OSError, ValueError, AttributeError):
            return ""
    if sizes[0] is None or sizes[0] != sizes[1]:
        return ""
    return f" (batch_size is per data-parallel rank: the global batch is {sizes[0]} sequences in both)"


def _flat_config(dump_dir: Path) -> dict:
    try:
        raw = json.loads((dump_dir / "train_config.json").read_text())
    except (OSError, ValueError):
        return {}

    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            out |= flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v}
        return out
    return flat(raw) if isinstance(raw, dict) else {}


_FORMATS = {64: ("<q", "<d", 0x7FFFFFFFFFFFFFFF), 32: ("<i", "<f", 0x7FFFFFFF)}


def ulps(a: float, b: float, bits: int = 64) -> int:
    """How many floats of `bits` (64 or 32) lie between a and b (0: bitwise equal)."""
    as_int, as_float, magnitude = _FORMATS[bits]

    def ordered(x: float) -> int:
        i = struct.unpack(as_int, struct.pack(as_float, x))[0]
        return i if i >= 0 else -(i & magnitude)
    return abs(ordered(a) - ordered(b))


def precision(*values: float) -> int:
    """32 when every value is a float32 (a grad norm computed in fp32), else 64: ulps are counted in
    the precision the values were computed in, where one rounding is one ulp."""
    try:
        return 32 if all(struct.unpack("<f", struct.pack("<f", v))[0] == v for v in values) else 64
    except OverflowError:
        return 64


def rel_diff(a: object, b: object) -> float:
    """0 for equal values; inf where one is missing, non-finite (null, nan, inf) or not a number and
    the other is not the same; else |a - b| / max(|a|, |b|)."""
    if is_finite_number(a) and is_finite_number(b):
        if a == b:  # 0.0 and -0.0 are equal but not bitwise: the smallest difference there is
            return 0.0 if math.copysign(1, a) == math.copysign(1, b) else math.ulp(0.0)
        return abs(a - b) / max(abs(a), abs(b))
    same_non_finite = not is_finite_number(a) and not is_finite_number(b) and a is not ABSENT and b is not ABSENT \
        and repr(a) == repr(b)
    return 0.0 if same_non_finite else math.inf


def _cell(x: object, y: object, rel: float) -> str:
    if is_finite_number(x) and is_finite_number(y):
        bits = precision(x, y)
        return f"{x!r:>22} {y!r:>22} {ulps(x, y, bits):>8} ulp{bits} {rel:9.2e}"
    shown = ["absent" if v is ABSENT else "non-finite" if v is None else repr(v) for v in (x, y)]
    return f"{shown[0]:>22} {shown[1]:>22} {'':>14} {rel:9.2e}"


def compare(a: dict[int, dict], b: dict[int, dict], rtol: float,
            fields: tuple[str, ...] = FIELDS) -> tuple[list[str], str, bool]:
    """(table rows, verdict line, whether the runs agree)."""
    steps = sorted(a.keys() & b.keys())
    rows, worst, compared, both_non_finite = [], (0.0, None, None), 0, 0
    for step in steps:
        cells = []
        for field in fields:
            x, y = a[step].get(field, ABSENT), b[step].get(field, ABSENT)
            for run, value in (("A", x), ("B", y)):  # two equal strings are not two equal NaNs
                check_number(value, f"run {run}: step {step} logs {field}")
            if x is ABSENT and y is ABSENT:
                cells.append(f"{'':>22} {'':>22} {'':>14} {'':>9}")
                continue
            rel = rel_diff(x, y)
            compared += 1
            both_non_finite += rel == 0.0 and not is_finite_number(x)
            worst = max(worst, (rel, step, field), key=lambda w: w[0])
            cells.append(_cell(x, y, rel))
        rows.append(f"{step:>6} | " + " | ".join(cells))
    only = sorted(a.keys() ^ b.keys())
    agree = worst[0] <= rtol and not only and bool(steps)
    if not steps:
        raise UnreadableMetrics("the runs logged no step in common: nothing to compare")
    if not compared:
        raise UnreadableMetrics(f"no {', '.join(fields)} values to compare in the common steps")
    if both_non_finite == compared:
        raise UnreadableMetrics(f"all {compared} compared values are non-finite in both runs: nothing trained to compare")
    if worst[0] == 0.0:
        verdict = f"bitwise equal over {len(steps)} steps{_unlogged(steps)}"
        if both_non_finite:
            verdict += f" ({both_non_finite} of {compared} values non-finite in both runs)"
    elif math.isinf(worst[0]):
        verdict = (f"values differ in kind at step {worst[1]} ({worst[2]}: missing or non-finite in one run, or "
                   "non-finite in both but not the same: NaN, Inf, -Inf)")
    else:
        verdict = f"max rel diff {worst[0]:.3e} at step {worst[1]} ({worst[2]}){_unlogged(steps)}"
    if only:  # a difference, whatever the common steps show: said first
        verdict = f"steps logged by one run only: {only[:10]}; the common steps: {verdict}"
    return rows, verdict, agree


def _unlogged(steps: list[int]) -> str:
    """What a verdict over `steps` (those both runs logged) did not see: how many steps up to the last of
    them are not among them (log_freq), where a difference can hide (a one-step difference need not
    reach the next logged loss)."""
    unseen = steps[-1] - len(steps)
    if unseen == 0:
        return ""
    return f" (of {steps[-1]}: {unseen} steps not logged by both runs; log_all_steps=true logs each)"


UNIT_FIELDS = ("unit_param_norms", "unit_grad_norms")  # metrics.unit_norms=true


def unit_divergence(a: dict[int, dict], b: dict[int, dict], rtol: float) -> str | None:
    """Where per-unit norms first differ beyond rtol (both runs with metrics.unit_norms=true): the step,
    which norm, and the first units in model order. Parameter norms come first: at a step they are the
    weights the gradients were computed at."""
    for step in sorted(a.keys() & b.keys()):
        for field in UNIT_FIELDS:
            x, y = a[step].get(field), b[step].get(field)
            if isinstance(x, dict) != isinstance(y, dict):
                return f"per-unit norms are logged by one run only, from step {step} ({field})"
            if not isinstance(x, dict):
                continue
            differ = [unit for unit in x if rel_diff(x[unit], y.get(unit, ABSENT)) > rtol]
            differ += [unit for unit in y if unit not in x]
            if differ:
                shown = ", ".join(differ[:4]) + (f" (+{len(differ) - 4} more)" if len(differ) > 4 else "")
                return f"per-unit norms first differ at step {step}, {field}: {shown}"
    return None


def copied_steps(a: dict[int, dict], b: dict[int, dict]) -> list[int]:
    """The common steps that ended at the same wall_time in both runs: records one run copied from the
    other (a dump_dir copied, then resumed), whose agreement proves nothing."""
    return sorted(s for s in a.keys() & b.keys()
                  if is_finite_number(a[s].get("wall_time")) and a[s].get("wall_time") == b[s].get("wall_time"))


def median_tflops(records: dict[int, dict]) -> float:
    values = [r["tflops"] for r in records.values() if is_finite_number(r.get("tflops"))]
    return statistics.median(values) if values else float("nan")


def _number(x: object) -> float:
    """A value to draw: non-finite or missing ones leave a gap (nan)."""
    return x if is_finite_number(x) else math.nan


def plot(a: dict[int, dict], b: dict[int, dict], labels: tuple[str, str], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    for records, label in zip((a, b), labels):
        steps = sorted(records)
        top.plot(steps, [_number(records[s].get("loss")) for s in steps], label=label)
    top.set_ylabel("loss")
    top.legend()
    common = sorted(a.keys() & b.keys())
    bottom.plot(common, [_number(b[s].get("loss")) - _number(a[s].get("loss")) for s in common], color="tab:red")
    bottom.axhline(0.0, color="black", linewidth=0.5)
    bottom.set_ylabel("loss B - A")
    bottom.set_xlabel("step")
    fig.tight_layout()
    save_figure(fig, out)


def tolerance(text: str) -> float:
    value = float(text)
    if not (value >= 0 and math.isfinite(value)):  # inf would pass values missing in one run
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def field_list(text: str) -> tuple[str, ...]:
    fields = tuple(dict.fromkeys(f for f in text.split(",") if f))
    if not fields or set(fields) - set(FIELDS):
        raise argparse.ArgumentTypeError(f"takes a comma-separated subset of {','.join(FIELDS)}, got {text!r}")
    return fields


def default_fields(a: dict[int, dict], b: dict[int, dict]) -> tuple[str, ...]:
    """Every field, less eval_loss when neither run evaluated (an empty column)."""
    evaluated = any("eval_loss" in r for r in [*a.values(), *b.values()])
    return tuple(f for f in FIELDS if evaluated or f != "eval_loss")


def _same_file(a: Path, b: Path) -> bool:
    """One folder given twice, through another path, a symlink or a hard link."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return a.resolve() == b.resolve()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump_a", type=run_folder)
    parser.add_argument("dump_b", type=run_folder)
    parser.add_argument("--rtol", type=tolerance, default=0.0, help="relative tolerance (default 0: bitwise)")
    parser.add_argument("--fields", type=field_list, help=f"what to compare (default {','.join(FIELDS)}; eval_loss only "
                        "where a run evaluated)")
    parser.add_argument("--plot", help="write an image of both loss curves and their difference (.png, .pdf, ...)")
    parser.add_argument("--brief", action="store_true", help="only the verdict and each run's median TFLOP/s")
    opts = parser.parse_args(argv)
    if opts.plot and (problem := image_problem(opts.plot)):  # checked before any output
        print(f"error: --plot {opts.plot}: {problem}", file=sys.stderr)
        return 2
    notes: list[str] = []
    try:
        if _same_file(opts.dump_a / "metrics.jsonl", opts.dump_b / "metrics.jsonl"):
            raise UnreadableMetrics(f"{opts.dump_a} and {opts.dump_b} hold the same metrics file: a run compared with "
                                    "itself proves nothing")
        a, b = read_metrics(opts.dump_a, notes), read_metrics(opts.dump_b, notes)
        same = copied_steps(a, b)
        if same and len(same) == len(a.keys() & b.keys()):
            raise UnreadableMetrics(f"every common step of {opts.dump_a} and {opts.dump_b} ended at the same wall_time: "
                                    "one run is a copy of the other, which proves nothing")
        if same:
            notes.append(f"{len(same)} common step(s), {same[0]} to {same[-1]}, ended at the same wall_time in both "
                         "runs: records copied from one run to the other, left out of the comparison")
            a, b = ({s: r for s, r in run.items() if s not in same} for run in (a, b))
        fields = opts.fields or default_fields(a, b)
        rows, verdict, agree = compare(a, b, opts.rtol, fields)
    except UnreadableMetrics as e:
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        print(f"error: {e}", file=sys.stderr)
        return 2
    divergence = unit_divergence(a, b, opts.rtol)
    if divergence:  # the weights or gradients differ, whatever the summed values show
        verdict, agree = f"{verdict}; but {divergence}", False
    for note in notes + config_notes(opts.dump_a, opts.dump_b, a, b):
        print(f"note: {note}", file=sys.stderr)
    if opts.brief:
        print(f"{verdict}; TFLOP/s {median_tflops(a):.4g} vs {median_tflops(b):.4g}")
    else:
        print(f"{'step':>6} | " + " | ".join(f"{f + ' A':>22} {f + ' B':>22} {'diff':>14} {'rel':>9}" for f in fields))
        print("\n".join(rows))
        print(verdict)
    if opts.plot:
        try:
            plot(a, b, (str(opts.dump_a), str(opts.dump_b)), opts.plot)
        except (OSError, ValueError) as e:
            print(f"error: --plot {opts.plot}: {e}", file=sys.stderr)
            return 2
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
