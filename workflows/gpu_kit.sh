#!/usr/bin/env bash
# Run a command on a GPU box whose Python has torch (and cupy) but not blockprep's other dependencies: install
# the wheels carried in .whl/ offline (never touching torch), put this checkout first on the path, then run it.
#   bash workflows/gpu_kit.sh python -m workflows.benchmark train --workload all --device cuda:0
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# kvikio's wheels (kvikio_cu13, libkvikio_cu13, rapids_logger: MONAI's GDSDataset) count only where carried;
# they use the box's own cupy, cuda-pathfinder and nvidia-cufile (CUDA 13 wheels, as torch cu130 brings them).
NEED="import monai, dask, nibabel, pydantic"
if compgen -G ".whl/kvikio_*.whl" >/dev/null; then NEED="${NEED}, kvikio.numpy"; fi
if [ -d .whl ] && ! "${PY}" -c "${NEED}" 2>/dev/null; then
    "${PY}" -m pip install -q --no-index --no-deps --compile .whl/*.whl
fi
export PYTHONPATH="${PWD}${PYTHONPATH:+:${PYTHONPATH}}"
exec "$@"
