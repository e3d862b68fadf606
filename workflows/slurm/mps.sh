#!/bin/bash
# A CUDA MPS control daemon of one job's own, so that the training process and the loader's feeder process share
# the GPU side by side instead of in time slices (docs/loaders.md, the feeder).
#
#   eval "$(bash workflows/slurm/mps.sh start DIR)"   # prints the two exports; the processes started after it use MPS
#   bash workflows/slurm/mps.sh stop DIR
#
# DIR holds the daemon's pipe and log folders (job-private: node-local scratch). Start it before the training
# process touches CUDA. Needs the NVIDIA driver's nvidia-cuda-mps-control and a GPU whose compute mode allows
# it (Default or Exclusive_Process); on failure `start` says why in one line on stderr and exits 1.
set -euo pipefail

usage() { echo "usage: mps.sh start|stop DIR" >&2; exit 2; }
[[ $# -eq 2 ]] || usage
action=$1
dir=$2
[[ "${dir}" == /* ]] || dir="${PWD}/${dir}"  # the exports must hold from any folder
export CUDA_MPS_PIPE_DIRECTORY="${dir}/pipe" CUDA_MPS_LOG_DIRECTORY="${dir}/log"

case "${action}" in
start)
    if ! command -v nvidia-cuda-mps-control >/dev/null; then
        echo "mps.sh: nvidia-cuda-mps-control not found (it comes with the NVIDIA driver's utilities); no MPS" >&2
        exit 1
    fi
    if command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=compute_mode --format=csv,noheader \
        | grep -qi prohibited; then
        echo "mps.sh: a GPU's compute mode is Prohibited (nvidia-smi -q); no MPS" >&2
        exit 1
    fi
    mkdir -p "${CUDA_MPS_PIPE_DIRECTORY}" "${CUDA_MPS_LOG_DIRECTORY}"
    if ! nvidia-cuda-mps-control -d; then
        echo "mps.sh: nvidia-cuda-mps-control -d failed (see ${CUDA_MPS_LOG_DIRECTORY}/control.log); no MPS" >&2
        exit 1
    fi
    echo "export CUDA_MPS_PIPE_DIRECTORY=${CUDA_MPS_PIPE_DIRECTORY} CUDA_MPS_LOG_DIRECTORY=${CUDA_MPS_LOG_DIRECTORY}"
    ;;
stop)
    if [[ -S "${CUDA_MPS_PIPE_DIRECTORY}/control" ]] || [[ -p "${CUDA_MPS_PIPE_DIRECTORY}/control" ]]; then
        echo quit | nvidia-cuda-mps-control || true
    fi
    ;;
*) usage ;;
esac
