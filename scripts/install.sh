#!/usr/bin/env bash
# Install the project into ./.venv (idempotent; a second run takes a second).
# Without a GPU, torch's CPU build is installed first, pinned, so resolving the other dependencies
# never pulls a multi-GB CUDA wheel. With a GPU, the project's own `torch>=2.6` picks the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

CPU_TORCH="torch==2.13.0"
stamp=.venv/.installed
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/install.sh ]; then
  exit 0
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
pip=(.venv/bin/python -m pip install -qq --disable-pip-version-check)
if ! command -v nvidia-smi >/dev/null 2>&1; then
  "${pip[@]}" "$CPU_TORCH"
fi
"${pip[@]}" -e ".[dev]"
touch "$stamp"
