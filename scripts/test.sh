#!/usr/bin/env bash
# Install, then run the whole test suite (unit, multi-process gloo, torchrun end to end) on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# Two pytest workers, one test file each at a time (module fixtures stay shared within a file): about
# a third of the suite is single-process work that leaves the second core idle.
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=20 "$@"
