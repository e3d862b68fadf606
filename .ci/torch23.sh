#!/usr/bin/env bash
# CI job 2: the HPC container versions, PyTorch 2.3.1 + MONAI 1.4.0 (PyPI's torch 2.3.1 is the CUDA 12.1 build;
# it runs on CPU). torch goes in first, as in a container; blockprep then goes in through the keep-torch recipe
# (workflows/install_keep_torch.sh), which fails if torch's files change. Then the `not slow` tests and the
# threaded `prep cache` stress test (torch 2.3's numpy-initialisation deadlock).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
VENV=${TORCH23_VENV:-.venv-torch23}
t0=$(date +%s)
test -x "${VENV}/bin/python" || "${PY}" -m venv "${VENV}"
"${VENV}/bin/python" -m pip install -q torch==2.3.1  # about 2.8 GB to download once; pip's cache after that
t1=$(date +%s)
PYTHON="${VENV}/bin/python" workflows/install_keep_torch.sh -q -e '.[dev,dali]'
"${VENV}/bin/python" -c 'import torch, monai; assert (torch.__version__.split("+")[0], monai.__version__) == ("2.3.1", "1.4.0"), (torch.__version__, monai.__version__)'
t2=$(date +%s)
read -r -a args <<< "${PYTEST_ARGS:--q}"
set +e
"${VENV}/bin/python" -m pytest "${args[@]}" -m "not slow"
rc=$?
if [ $rc -eq 0 ]; then
  "${VENV}/bin/python" -m pytest "${args[@]}" tests/prep/test_threads_stress.py
  rc=$?
fi
set -e
echo "torch23 job: torch $((t1 - t0)) s, blockprep $((t2 - t1)) s, tests $(($(date +%s) - t2)) s"
if [ $rc -eq 5 ]; then echo "no tests were collected"; exit 1; fi
exit $rc
