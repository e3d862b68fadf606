#!/usr/bin/env bash
# Install blockprep into a Python whose PyTorch must stay as it is (an HPC container's CUDA/ROCm build, a site
# build): pip gets constraints pinning torch to the installed version and MONAI to a release that supports it
# (workflows/keep_torch.py), so it can add packages but never replace torch; torch's RECORD is compared after.
#
#   workflows/install_keep_torch.sh                      # this checkout, into `python3`
#   PYTHON=/opt/venv/bin/python workflows/install_keep_torch.sh -e '.[dev]'
#   workflows/install_keep_torch.sh --user /path/to/blockprep    # any `pip install` arguments
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "${here}")
PYTHON=${PYTHON:-python3}
[[ $# -gt 0 ]] || set -- "${root}"

constraints=$(mktemp)
trap 'rm -f "${constraints}"' EXIT
"${PYTHON}" "${here}/keep_torch.py" > "${constraints}"
echo "install_keep_torch: constraints: $(tr '\n' ' ' < "${constraints}")"
# torch's version and the hash of its RECORD (every installed file with its hash)
torch_id='import hashlib, importlib.metadata as m; d = m.distribution("torch")
print(d.version, hashlib.sha256((d.read_text("RECORD") or "").encode()).hexdigest())'
before=$("${PYTHON}" -c "${torch_id}")
"${PYTHON}" -m pip install -c "${constraints}" "$@"
after=$("${PYTHON}" -c "${torch_id}")
if [[ "${before}" != "${after}" ]]; then
    echo "install_keep_torch: error: torch changed (${before} -> ${after})" >&2
    exit 1
fi
echo "install_keep_torch: torch ${before%% *} kept"
