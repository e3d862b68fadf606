#!/usr/bin/env bash
# CI: install SLURM (slurm-wlm 22.05 on Debian 12) and munge for the tests that start a one-node cluster on
# localhost (tests/slurmcluster.py), and openssl for the TLS tests. Nothing is started or enabled here:
# the tests run the daemons themselves. Without root the SLURM tests skip and say why.
set -euo pipefail
need=()
for bin in slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client munged:munge openssl:openssl; do
    command -v "${bin%%:*}" >/dev/null || need+=("${bin##*:}")
done
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" != 0 ]; then
    echo "warning: not root, cannot install ${need[*]}; the SLURM tests will skip"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q || true
# slurm-wlm pulls slurmctld, slurmd and slurm-client; policy-rc.d keeps the packages from starting daemons
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
    trap 'rm -f /usr/sbin/policy-rc.d' EXIT
fi
apt-get install -y -q slurm-wlm munge openssl \
    || echo "warning: could not install slurm-wlm munge openssl; the SLURM tests will skip"
