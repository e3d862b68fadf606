#!/bin/bash
# A CUDA MPS control daemon of one job's own, so that the training process and the loader's feeder process share
# the GPU side by side instead of in time slices (docs/loaders.md, the feeder).
#
#   eval "$(bash workflows/slurm/mps.sh start DIR)"   # prints the two exports; the processes started after it use MPS
#   bash workflows/slurm/mps.sh stop DIR
#   bash workflows/slurm/mps.sh run DIR -- python train.py ...   # the command under a daemon of its own, stopped
#                                                              # after it; without MPS where it cannot start (said)
#
# DIR holds the daemon's pipe and log folders (job-private: node-local scratch). Start it before the training
# process touches CUDA. Needs the NVIDIA driver's nvidia-cuda-mps-control and a GPU whose compute mode allows
# it (Default or Exclusive_Process); on failure `start` says why in one line on stderr and exits 1.
set -euo pipefail

usage() { echo "usage: mps.sh start|stop DIR, or mps.sh run DIR -- COMMAND [ARGS...]" >&2; exit 2; }
[[ $# -ge 2 ]] || usage
action=$1
dir=$2
shift 2
if [[ "${action}" == "run" ]]; then
    [[ "${1:-}" == "--" ]] && shift
    [[ $# -ge 1 ]] || usage
elif [[ $# -ne 0 ]]; then
    usage
fi
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
run)
    started=0
    if exports=$(bash "${BASH_SOURCE[0]}" start "${dir}"); then
        eval "${exports}"
        started=1
    else
        echo "mps.sh: running without MPS" >&2
        unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    fi
    status=0
    "$@" || status=$?
    if [[ "${started}" == "1" ]]; then bash "${BASH_SOURCE[0]}" stop "${dir}"; fi
    exit "${status}"
    ;;
*) usage ;;
esac
