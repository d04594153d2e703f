#!/usr/bin/env bash
# Install, then run the whole test suite (unit, multi-process gloo, torchrun end to end) on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# pytest, where exit code 5 (nothing selected: a run of chosen tests may hold none of a part) passes.
run_pytest() {
    local rc=0
    .venv/bin/python -m pytest "$@" || rc=$?
    [ "$rc" -eq 5 ] && rc=0
    return "$rc"
}
# Two pytest workers, one test file each at a time (module fixtures stay shared within a file): about
# a third of the suite is single-process work that leaves the second core idle.
run_pytest -q -n 2 --dist loadfile --durations=20 -m "not alone" "$@"
# Then the tests that time the machine, with nothing beside them.
run_pytest -q -m alone "$@"
