"""Curves of one or more runs on one figure: loss (and eval loss where logged), tokens/s, peak memory, LR.

    python scripts/plot_metrics.py DUMP [DUMP ...] --out curves.png

--out names the image; its extension picks the format (.png, .pdf, .svg, ...).
"""

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.image_output import image_problem, save_figure  # noqa: E402
from scripts.metrics_file import UnreadableMetrics, check_number, is_finite_number, read_metrics, run_folder  # noqa: E402

PANELS = (("loss", "loss"), ("tokens_per_s", "tokens/s"), ("mem_peak_gib", "peak memory (GiB)"), ("lr", "learning rate"))
Curves = dict[str, tuple[list[int], list[float]]]  # field -> (steps that logged it, values)


def curves(dump: Path, notes: list[str]) -> Curves:
    """Every panel's (and eval loss's) curve of one run. Raises UnreadableMetrics for a run with none of
    the panels' fields, or a value that is not a number; `notes` gets the panels it leaves empty."""
    records = read_metrics(dump, notes)  # a partial last line (a run still writing) is left out, noted
    path, fields = dump / "metrics.jsonl", [field for field, _ in PANELS]
    drawn: Curves = {}
    for field in (*fields, "eval_loss"):
        steps = [s for s in sorted(records) if field in records[s]]
        drawn[field] = (steps, [_value(records[s][field], f"{path}: step {s} logs {field}") for s in steps])
    missing = [field for field in fields if not drawn[field][0]]
    if missing == fields:
        raise UnreadableMetrics(f"{path} logs none of {', '.join(fields)}: nothing to draw")
    if missing:
        notes.append(f"{path} logs no {', '.join(missing)}: its curve is missing from those panels")
    return drawn


def _value(value: object, what: str) -> float:
    """A logged value to draw: nan (a gap) for a non-finite one (logged as null) or one past a float's range."""
    check_number(value, what)
    try:
        return float(value) if is_finite_number(value) else math.nan
    except OverflowError:  # an integer too large for a float
        return math.nan


def plot(dumps: list[Path], out: str, notes: list[str]) -> None:
    """Reads every run before drawing (see curves for what it raises); `notes` gets what was left out."""
    runs = [(dump, curves(dump, notes)) for dump in dumps]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for dump, drawn in runs:
        for ax, (field, title) in zip(axes.flat, PANELS):
            line = ax.plot(*drawn[field], label=str(dump))[0]
            if field == "loss" and drawn["eval_loss"][0]:
                # Markers: a run that evaluated once (or has so far) has one point, which a line omits.
                ax.plot(*drawn["eval_loss"], "--o", markersize=3, color=line.get_color(), label=f"{dump} (eval)")
            ax.set_title(title)
    axes[0, 0].legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    save_figure(fig, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dumps", type=run_folder, nargs="+")
    parser.add_argument("--out", required=True, help="the image to write; its extension picks the format")
    opts = parser.parse_args(argv)
    if problem := image_problem(opts.out):  # before reading: matplotlib would write elsewhere, or fail
        print(f"error: --out {opts.out}: {problem}", file=sys.stderr)
        return 2
    notes: list[str] = []
    try:
        plot(opts.dumps, opts.out, notes)
    except UnreadableMetrics as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as e:  # what the checks cannot foresee: a full disk, a picture too big
        print(f"error: --out {opts.out}: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
