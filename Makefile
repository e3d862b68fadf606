# blockprep: every target installs what it needs into .venv (under the repo) on first use.
SHELL := /bin/bash
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO ?= demo
DATALIST ?= $(DEMO)/nifti/dataset.json
PIPELINE ?= workflows/pipelines/spheres.py
CACHE ?= $(DEMO)/cache
MOUNTPOINT ?= $(DEMO)
BMAP ?= $(DEMO)/bmap.json
# the demo folder is not a mountpoint; for a real one: make bmap MOUNTPOINT=/mnt/nvme BMAP_ARGS=
BMAP_ARGS ?= --allow-subdir
PYTEST_ARGS ?=
# `make test`: the suite a developer runs before each commit; `make test-all` (CI) adds the slow and system tests
TEST_MARKERS ?= not slow and not slurm
BENCH_ARGS ?= --batchsize 4 --batches 4 --cold --out bench_out
# CPU torch by default; pass TORCH_PIP_ARGS="--index-url <your CPU wheel index>" where needed.
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=

# Into an existing Python whose torch must stay (HPC container): make install-keep-torch PY=/path/to/python
KEEP_TORCH_ARGS ?= -e .

.PHONY: install install-keep-torch demo test test-all test-gpu lint typecheck bench cache bmap clean

install: $(STAMP)

# torch: keep a CUDA/ROCm build that is already importable; otherwise take the CPU build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q $(TORCH_SPEC) $(TORCH_PIP_ARGS)
	$(BIN)/python -m pip install -q -e '.[dev,dali]'
	touch $(STAMP)

# pip constrained to the installed torch (and a MONAI that supports it); fails if torch's files changed
install-keep-torch:
	PYTHON=$(PY) workflows/install_keep_torch.sh $(KEEP_TORCH_ARGS)

demo: install
	$(BIN)/python -m workflows.demo --out $(DEMO)

test: install
	$(BIN)/python -m pytest -m "$(TEST_MARKERS)" $(PYTEST_ARGS)

# + install, stress, dask-cluster, SLURM, DDP and README/docs-block tests: what .ci/run runs
test-all: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# the tests marked gpu, on a GPU box (elsewhere each skips, naming why); a box whose Python has torch but not the
# other dependencies runs them as `bash workflows/gpu_kit.sh python -m pytest -m gpu` (the wheels carried in .whl/)
test-gpu: install
	$(BIN)/python -m pytest -m gpu $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check prep loaders workflows tests
	$(BIN)/ruff format --check prep loaders workflows tests

typecheck: install
	$(BIN)/mypy prep loaders workflows

# A few minutes on 2 cores: every way of loading the demo volumes and images, one table (+ CSV/JSON/PNG).
bench: install
	test -f $(DEMO)/cache/manifest.json || $(MAKE) demo
	$(BIN)/python -m workflows.benchmark all --data $(DEMO) $(BENCH_ARGS)

cache: install
	$(BIN)/prep cache $(DATALIST) --pipeline $(PIPELINE) --output $(CACHE)

bmap: install
	$(BIN)/prep bmap --mountpoint $(MOUNTPOINT) --output $(BMAP) $(BMAP_ARGS)

clean:
	rm -rf $(DEMO) bench_out .pytest_cache .mypy_cache .ruff_cache build *.egg-info
