#!/bin/bash
# Submit one training job per combination of settings (sbatch --export passes them to train.sbatch).
#
#   SHARED_CACHE=/project/me/cache_spheres workflows/slurm/sweep.sh
#   DRY_RUN=1 BACKENDS="posix direct" BATCHSIZES="2 4" SHARED_CACHE=/p/cache workflows/slurm/sweep.sh
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SCRIPT=${SCRIPT:-${here}/train.sbatch}
SHARED_CACHE=${SHARED_CACHE:?set SHARED_CACHE to the prepared cache on shared storage}
read -r -a backends <<< "${BACKENDS:-posix direct auto}"
read -r -a batchsizes <<< "${BATCHSIZES:-2 4}"
read -r -a loaders <<< "${LOADERS:-blockprep}"
ITERS=${ITERS:-200}

for loader in "${loaders[@]}"; do
    for backend in "${backends[@]}"; do
        for bs in "${batchsizes[@]}"; do
            cmd=(sbatch --job-name="bp-${loader}-${backend}-b${bs}"
                 --export="ALL,SHARED_CACHE=${SHARED_CACHE},LOADER=${loader},BACKEND=${backend},BATCHSIZE=${bs},ITERS=${ITERS}"
                 "${SCRIPT}")
            if [[ "${DRY_RUN:-0}" == "1" ]]; then
                printf '%q ' "${cmd[@]}"
                echo
            else
                "${cmd[@]}"
            fi
        done
    done
done
