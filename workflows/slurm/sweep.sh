#!/bin/bash
# Submit one training job per combination of settings (sbatch --export passes them to train.sbatch).
#
#   SHARED_CACHE=/project/me/cache_spheres workflows/slurm/sweep.sh
#   DRY_RUN=1 BACKENDS="posix direct" BATCHSIZES="2 4" SHARED_CACHE=/p/cache workflows/slurm/sweep.sh
#   SBATCH_ARGS="--partition=cpu --gres=none --mem=8G" DEVICE=cpu SHARED_CACHE=/p/cache workflows/slurm/sweep.sh
# Each job writes <job name>-<job id>.out in the current folder; the job ids are printed one per line.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
SCRIPT=${SCRIPT:-${here}/train.sbatch}
SHARED_CACHE=${SHARED_CACHE:?set SHARED_CACHE to the prepared cache on shared storage}
read -r -a backends <<< "${BACKENDS:-posix direct auto}"
read -r -a batchsizes <<< "${BATCHSIZES:-2 4}"
read -r -a loaders <<< "${LOADERS:-fast}"
ITERS=${ITERS:-200}
read -r -a sbatch_args <<< "${SBATCH_ARGS:-}"   # site options for every job (partition, account, gres)

for loader in "${loaders[@]}"; do
    for backend in "${backends[@]}"; do
        for bs in "${batchsizes[@]}"; do
            cmd=(sbatch --parsable "${sbatch_args[@]}" --job-name="bp-${loader}-${backend}-b${bs}"
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
