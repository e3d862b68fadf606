#!/usr/bin/env bash
# Run a command on a GPU box whose Python has torch (and cupy) but not blockprep's other dependencies: install
# the wheels carried in .whl/ offline (never touching torch), put this checkout first on the path, then run it.
#   bash workflows/gpu_kit.sh python -m workflows.benchmark train --workload all --device cuda:0
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ -d .whl ] && ! "${PY}" -c "import monai, dask, nibabel" 2>/dev/null; then
    "${PY}" -m pip install -q --no-index --no-deps --compile .whl/*.whl
fi
export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}"
exec "$@"
