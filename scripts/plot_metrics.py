"""Curves of one or more runs on one figure: loss (and eval loss where logged), tokens/s, peak memory, LR.

    python scripts/plot_metrics.py DUMP [DUMP ...] --out curves.png
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.compare_runs import UnreadableMetrics, read_metrics, run_folder  # noqa: E402

PANELS = (("loss", "loss"), ("tokens_per_s", "tokens/s"), ("mem_peak_gib", "peak memory (GiB)"), ("lr", "learning rate"))


def plot(dumps: list[Path], out: str, notes: list[str]) -> None:
    """Raises UnreadableMetrics for a run with nothing to draw; `notes` gets what was left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    for dump in dumps:
        records = read_metrics(dump, notes)  # a partial last line (a run still writing) is left out, noted
        steps = sorted(records)
        for ax, (field, title) in zip(axes.flat, PANELS):
            logged = [s for s in steps if field in records[s]]
            line = ax.plot(logged, [records[s][field] for s in logged], label=str(dump))[0]
            if field == "loss":
                evals = [s for s in steps if "eval_loss" in records[s]]
                if evals:
                    # Markers: a run that evaluated once (or has so far) has one point, which a line omits.
                    ax.plot(evals, [records[s]["eval_loss"] for s in evals], "--o", markersize=3,
                            color=line.get_color(), label=f"{dump} (eval)")
            ax.set_title(title)
    axes[0, 0].legend(fontsize=7)
    for ax in axes[1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dumps", type=run_folder, nargs="+")
    parser.add_argument("--out", required=True)
    opts = parser.parse_args(argv)
    notes: list[str] = []
    try:
        plot(opts.dumps, opts.out, notes)
    except UnreadableMetrics as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(f"wrote {opts.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
