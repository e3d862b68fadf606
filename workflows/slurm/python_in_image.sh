#!/bin/bash
# `python` inside the Apptainer image, for train.sbatch's PYTHON: train_apptainer.sbatch exports IMAGE, GPU_FLAG,
# BINDS (comma-separated folders the container sees) and VENV (the per-image venv that holds blockprep).
# exec, so that a signal sent to this process (srun forwards the time limit's USR1) reaches the container.
set -euo pipefail
exec apptainer exec "${GPU_FLAG:---nv}" --bind "${BINDS:?}" --env PATH="${VENV:?}/bin:/usr/local/bin:/usr/bin:/bin" \
    "${IMAGE:?}" python "$@"
