"""Cluster templates: every shell script parses and passes shellcheck; the jobqueue recipe runs."""

from __future__ import annotations

import py_compile
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SLURM = Path(__file__).parents[2] / "workflows" / "slurm"
SCRIPTS = sorted([*SLURM.glob("*.sbatch"), *SLURM.glob("*.sh")])


def test_templates_exist() -> None:
    names = {p.name for p in SCRIPTS}
    assert {"train.sbatch", "train_apptainer.sbatch", "sweep.sh"} <= names
    assert (SLURM / "README.md").is_file() and (SLURM / "blockprep.def").is_file()


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_bash_parses(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_shellcheck(script: Path) -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    proc = subprocess.run(["shellcheck", "--shell=bash", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_sweep_dry_run_submits_one_job_per_combination() -> None:
    env = {"PATH": "/usr/bin:/bin", "DRY_RUN": "1", "SHARED_CACHE": "/shared/cache", "BACKENDS": "posix direct",
           "BATCHSIZES": "2 4 8", "ITERS": "5"}  # fmt: skip
    proc = subprocess.run(["bash", str(SLURM / "sweep.sh")], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert len(lines) == 6 and all(line.startswith("sbatch ") for line in lines)
    assert any("BACKEND=direct" in line and "BATCHSIZE=8" in line and "ITERS=5" in line for line in lines)


def test_sweep_requires_the_shared_cache() -> None:
    proc = subprocess.run(["bash", str(SLURM / "sweep.sh")], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "DRY_RUN": "1"})  # fmt: skip
    assert proc.returncode != 0 and "SHARED_CACHE" in proc.stderr


def test_jobqueue_recipe_compiles_and_helps() -> None:
    py_compile.compile(str(SLURM / "prep_cache_jobqueue.py"), doraise=True)
    proc = subprocess.run([sys.executable, str(SLURM / "prep_cache_jobqueue.py"), "--help"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--jobs" in proc.stdout and "--dry-run" in proc.stdout


def test_jobqueue_dry_run_prints_the_worker_job(tmp_path: Path) -> None:
    pytest.importorskip("dask_jobqueue", reason="pip install 'blockprep[slurm]'")
    args = [sys.executable, str(SLURM / "prep_cache_jobqueue.py"), "data.json", "--pipeline", "p.py",
            "--output", str(tmp_path / "cache"), "--cores", "4", "--queue", "cpu", "--account", "proj",
            "--job-extra=--constraint=nvme", "--dry-run"]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for directive in ("#SBATCH -p cpu", "#SBATCH -A proj", "#SBATCH --cpus-per-task=4", "#SBATCH --constraint=nvme"):
        assert directive in proc.stdout
    assert "dask_worker" in proc.stdout and not (tmp_path / "cache").exists()
