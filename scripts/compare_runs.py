"""Compare two runs step by step: losses, grad norms and eval losses, in ulps (of float32 where both
values are float32s, as grad norms are; else of float64) and relative terms, with
one verdict.

    python scripts/compare_runs.py DUMP_A DUMP_B [--rtol R] [--plot out.png] [--brief]

Reads `metrics.jsonl` of both dump_dirs. Exit code 0 when every common step's loss, grad norm and eval
loss agree within --rtol (default 0: bit for bit) and both runs logged the same steps and fields, 1
otherwise, 2 on unreadable input. A non-finite value (logged as null) agrees only with a non-finite
value at the same step; a field one run logged and the other did not is a difference. --plot draws both
loss curves and their difference; --brief prints only the verdict line with each run's median TFLOP/s
(for scripts such as numerics_matrix.sh).
"""

import argparse
import json
import math
import statistics
import struct
import sys
from pathlib import Path

FIELDS = ("loss", "grad_norm", "eval_loss")
ABSENT = object()  # a field the record does not have (eval_loss on non-eval steps)


class UnreadableMetrics(Exception):
    pass


def read_metrics(dump_dir: Path) -> dict[int, dict]:
    path = dump_dir / "metrics.jsonl"
    try:
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        by_step = {int(r["step"]): r for r in records}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UnreadableMetrics(f"{path} is not a readable metrics file: {e}") from None
    if len(by_step) != len(records):
        raise UnreadableMetrics(f"{path} logs some step twice (a resumed run moves the steps it redoes away)")
    return by_step


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


def is_finite_number(x: object) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def rel_diff(a: object, b: object) -> float:
    """0 for equal values; inf where one is missing, non-finite (null, nan, inf) or not a number and
    the other is not the same; else |a - b| / max(|a|, |b|)."""
    if is_finite_number(a) and is_finite_number(b):
        return 0.0 if a == b else abs(a - b) / max(abs(a), abs(b))
    same_non_finite = not is_finite_number(a) and not is_finite_number(b) and a is not ABSENT and b is not ABSENT \
        and repr(a) == repr(b)
    return 0.0 if same_non_finite else math.inf


def _cell(x: object, y: object, rel: float) -> str:
    if is_finite_number(x) and is_finite_number(y):
        bits = precision(x, y)
        return f"{x!r:>22} {y!r:>22} {ulps(x, y, bits):>8} ulp{bits} {rel:9.2e}"
    shown = ["absent" if v is ABSENT else "non-finite" if v is None else repr(v) for v in (x, y)]
    return f"{shown[0]:>22} {shown[1]:>22} {'':>14} {rel:9.2e}"


def compare(a: dict[int, dict], b: dict[int, dict], rtol: float) -> tuple[list[str], str, bool]:
    """(table rows, verdict line, whether the runs agree)."""
    steps = sorted(a.keys() & b.keys())
    rows, worst = [], (0.0, None, None)
    for step in steps:
        cells = []
        for field in FIELDS:
            x, y = a[step].get(field, ABSENT), b[step].get(field, ABSENT)
            if x is ABSENT and y is ABSENT:
                cells.append(f"{'':>22} {'':>22} {'':>14} {'':>9}")
                continue
            rel = rel_diff(x, y)
            worst = max(worst, (rel, step, field), key=lambda w: w[0])
            cells.append(_cell(x, y, rel))
        rows.append(f"{step:>6} | " + " | ".join(cells))
    only = sorted(a.keys() ^ b.keys())
    agree = worst[0] <= rtol and not only and bool(steps)
    if not steps:
        verdict = "no common steps"
    elif worst[0] == 0.0:
        verdict = f"bitwise equal over {len(steps)} steps"
    elif math.isinf(worst[0]):
        verdict = f"values differ in kind at step {worst[1]} ({worst[2]}: missing or non-finite in one run)"
    else:
        verdict = f"max rel diff {worst[0]:.3e} at step {worst[1]} ({worst[2]})"
    if only:  # a difference, whatever the common steps show: said first
        verdict = f"steps logged by one run only: {only[:10]}; the common steps: {verdict}"
    return rows, verdict, agree


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
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dump_a", type=Path)
    parser.add_argument("dump_b", type=Path)
    parser.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0: bitwise)")
    parser.add_argument("--plot", help="write a PNG of both loss curves and their difference")
    parser.add_argument("--brief", action="store_true", help="only the verdict and each run's median TFLOP/s")
    opts = parser.parse_args(argv)
    try:
        a, b = read_metrics(opts.dump_a), read_metrics(opts.dump_b)
    except UnreadableMetrics as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    rows, verdict, agree = compare(a, b, opts.rtol)
    if opts.brief:
        print(f"{verdict}; TFLOP/s {median_tflops(a):.4g} vs {median_tflops(b):.4g}")
    else:
        print(f"{'step':>6} | " + " | ".join(f"{f + ' A':>22} {f + ' B':>22} {'diff':>14} {'rel':>9}" for f in FIELDS))
        print("\n".join(rows))
        print(verdict)
    if opts.plot:
        plot(a, b, (str(opts.dump_a), str(opts.dump_b)), opts.plot)
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
