#!/usr/bin/env bash
# Install, then run the whole test suite (unit, multi-process gloo, torchrun end to end) on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest -q --durations=20 "$@"
