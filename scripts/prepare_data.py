"""Prepare a run's data ahead of the job: the tokenizer and the packed tokens, into data.cache_dir.

    python scripts/prepare_data.py [hydra overrides, as train.py takes them]

The config is composed and checked as train.py does it, and the data is built as a job's rank 0 builds it
(the same cache key, the same bytes), so a job started afterwards with the same data.* keys finds the
cache and tokenizes nothing. Tokenizing runs in data.prepare_workers processes (every usable core by
default); the progress (files, MB, MB/s, ETA) goes to stderr, the cache folder to stdout (one per source
of a blend). A bad override,
config or source is one `error:` line, exit code 2.
"""

import sys
from pathlib import Path

# Scripts run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.errors import ConfigError  # noqa: E402
from scripts.inspect_data import compose_config  # noqa: E402
from trainer.checkpoint.resume import resumed_checkpoint  # noqa: E402
from trainer.data.build import build_data  # noqa: E402


def progress(line: str) -> None:
    """On a terminal a progress line overwrites the one before; in a log every line stays."""
    if line.startswith("data: tokenized [") and sys.stderr.isatty():
        end = "\n" if "] 100%" in line else ""
        print(f"\r\033[K{line}", end=end, file=sys.stderr, flush=True)
    else:
        print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    overrides = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in overrides):
        print(__doc__)
        return 0
    try:
        cfg = compose_config(overrides, 1)
        # As rank 0 of a job: the same choice of tokenizer (a resumed run's copy included) and the same cache.
        data = build_data(cfg, 0, 1, 0, progress, resumed_checkpoint(cfg), agree=lambda key: None)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    for part in data.loader.tokens.parts:
        print(part.path, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
