"""Installing next to a torch that must stay: version ranges, the keep-torch constraints, the recipe itself."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from workflows.keep_torch import constraints, monai_for

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "workflows" / "install_keep_torch.sh"
# the guide's AMD container build, PyPI's CUDA 12.1 build, this repo's CPU build
CONTAINER_TORCH = "2.3.0a0+gitd2f9472"
TORCH_23 = "2.3.1"


def _requirement(name: str) -> Requirement:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == name)


@pytest.mark.parametrize("version", [CONTAINER_TORCH, "2.3.0", TORCH_23, "2.4.0+rocm6.1", "2.13.0+cpu"])
def test_torch_range_admits_container_builds(version: str) -> None:
    # prereleases=None: pip's own rule for a version it would have to accept from a range
    assert _requirement("torch").specifier.contains(version, prereleases=None)


@pytest.mark.parametrize("version", ["2.2.2", "2.2.0+cu121", "1.13.1"])
def test_torch_range_refuses_older(version: str) -> None:
    assert not _requirement("torch").specifier.contains(version, prereleases=True)


@pytest.mark.parametrize(
    "torch_version, monai",
    [(CONTAINER_TORCH, "monai>=1.4,<1.5"), (TORCH_23, "monai>=1.4,<1.5"), ("2.4.1a0", "monai>=1.4,<1.5"),
     ("2.4.1", "monai>=1.5.1,<1.6"), ("2.7.1+rocm6.3", "monai>=1.5.1,<1.6"), ("2.8.0", None), ("2.13.0+cpu", None)],
)  # fmt: skip
def test_monai_line_follows_torch(torch_version: str, monai: str | None) -> None:
    assert monai_for(torch_version) == monai
    assert constraints(torch_version)[0] == f"torch=={torch_version}"
    # the pin itself is what pip needs to keep exactly that build
    assert Requirement(constraints(torch_version)[0]).specifier.contains(torch_version, prereleases=True)


def test_installed_monai_fits_installed_torch() -> None:
    """Here (torch 2.13 + MONAI 1.6, or the CI job's torch 2.3.1 + MONAI 1.4): the constraints admit the MONAI
    installed, and that MONAI's own metadata admits the torch installed."""
    torch_version, monai_version = md.version("torch"), md.version("monai")
    pin = monai_for(torch_version)
    if pin is not None:
        assert Requirement(pin).specifier.contains(monai_version, prereleases=True)
    needs = [Requirement(r) for r in md.requires("monai") or [] if ";" not in r]
    needs = [r for r in needs if r.name == "torch"]
    assert needs and all(r.specifier.contains(torch_version, prereleases=True) for r in needs)


_TORCH_FILES = """
import hashlib, importlib.metadata as m, json, sys
d = m.distribution("torch")
files = {}
for f in d.files or []:
    p = f.locate()
    files[str(f)] = hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None
print(json.dumps({"version": d.version, "record": d.read_text("RECORD"), "files": files}))
"""


def _torch_files(python: Path) -> dict:
    out = subprocess.run([str(python), "-c", _TORCH_FILES], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def _venv_with_torch23(root: Path) -> Path:
    """A fresh venv holding PyPI's torch 2.3.1 (pip's cache makes a repeat quick), or skip saying why."""
    if shutil.disk_usage(root.parent).free < 12 << 30:
        pytest.skip(f"torch {TORCH_23} venv needs about 6 GB free under {root} (twice that to be safe)")
    venv.create(root, with_pip=True)
    python = root / "bin" / "python"
    proc = subprocess.run([str(python), "-m", "pip", "install", "-q", f"torch=={TORCH_23}"], capture_output=True,
                          text=True, timeout=1800)  # fmt: skip
    if proc.returncode != 0:
        pytest.skip(f"cannot build a torch {TORCH_23} venv here (offline?): {proc.stderr.strip()[-300:]}")
    return python


@pytest.mark.slow
def test_keep_torch_recipe_never_touches_torch(tmp_path: Path) -> None:
    python = _venv_with_torch23(tmp_path / "venv")
    before = _torch_files(python)
    assert before["version"].startswith(TORCH_23) and before["files"]
    env = {**os.environ, "PYTHON": str(python)}
    env.pop("PYTHONPATH", None)  # the venv must import what the recipe installed
    proc = subprocess.run(["bash", str(SCRIPT), str(REPO)], capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    after = _torch_files(python)
    # same RECORD, and every file it lists still on disk with the same bytes
    assert after == before
    monai = subprocess.run([str(python), "-c", "import monai, prep, loaders; print(monai.__version__)"],
                           capture_output=True, text=True, env=env, cwd=tmp_path)  # fmt: skip
    assert monai.returncode == 0 and monai.stdout.strip() == "1.4.0", monai.stderr[-2000:]


def test_recipe_refuses_python_without_torch(tmp_path: Path) -> None:
    venv.create(tmp_path / "bare", with_pip=False)
    env = {**os.environ, "PYTHON": str(tmp_path / "bare" / "bin" / "python")}
    proc = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env)
    assert proc.returncode == 1 and "no torch to keep" in proc.stderr, proc.stdout + proc.stderr
