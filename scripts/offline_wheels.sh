#!/usr/bin/env bash
# Wheels for a machine without network that already has a CUDA PyTorch (a cluster image, an air-gapped
# GPU box): the project's small dependencies such images usually lack, downloaded here for the target's
# Python, plus antlr4's runtime, which is published only as source and is built here into a wheel.
#
#   bash scripts/offline_wheels.sh OUT_DIR [PYTHON_VERSION (default 3.12)] [PACKAGE==VERSION ...]
#
# On the offline machine, from the checkout:
#   python3 -m pip install --no-index --no-deps --target /tmp/site OUT_DIR/*.whl
#   PYTHONPATH=/tmp/site bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
  echo "usage: offline_wheels.sh OUT_DIR [PYTHON_VERSION] [PACKAGE==VERSION ...]" >&2
  exit 2
fi
out=$1
version=${2:-3.12}
shift $(( $# < 2 ? $# : 2 ))
PY=.venv/bin/python
[ -x "$PY" ] || PY=python3
packages=("$@")
if [ ${#packages[@]} -eq 0 ]; then  # the versions installed here (the tested ones), else the newest
  read -r -a packages < <("$PY" -c "
from importlib.metadata import PackageNotFoundError, version
names = []
for name in ('hydra-core', 'omegaconf', 'zstandard'):
    try:
        names.append(f'{name}=={version(name)}')
    except PackageNotFoundError:
        names.append(name)
print(' '.join(names))")
fi
mkdir -p "$out"
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
           manylinux1_x86_64 any; do
  platforms+=(--platform "$tag")
done
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --implementation cp \
  --python-version "$version" "${platforms[@]}" -d "$out" "${packages[@]}"
"$PY" -m pip wheel -q --disable-pip-version-check --no-deps -w "$out" antlr4-python3-runtime==4.9.3
ls "$out"
