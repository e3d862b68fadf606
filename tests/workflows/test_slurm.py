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


def test_jobqueue_recipe_compiles_and_helps(tmp_path: Path) -> None:
    py_compile.compile(str(SLURM / "prep_cache_jobqueue.py"), cfile=str(tmp_path / "recipe.pyc"), doraise=True)
    proc = subprocess.run([sys.executable, str(SLURM / "prep_cache_jobqueue.py"), "--help"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "--jobs" in proc.stdout and "--dry-run" in proc.stdout


def test_jobqueue_dry_run_prints_the_worker_job(tmp_path: Path) -> None:
    pytest.importorskip("dask_jobqueue", reason="pip install 'blockprep[slurm]'")
    args = [sys.executable, str(SLURM / "prep_cache_jobqueue.py"), "data.json", "--pipeline", "p.py",
            "--output", str(tmp_path / "cache"), "--cores", "4", "--queue", "cpu", "--account", "proj",
            "--job-extra=--constraint=nvme", "--tls-dir", str(tmp_path / "tls"), "--dry-run"]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for directive in ("#SBATCH -p cpu", "#SBATCH -A proj", "#SBATCH --cpus-per-task=4", "#SBATCH --constraint=nvme"):
        assert directive in proc.stdout
    assert "dask_worker" in proc.stdout and not (tmp_path / "cache").exists()
    # TLS by default: the worker gets this run's temporary certificate, written where only we can read it
    assert "tls://" in proc.stdout and f"--tls-key {tmp_path / 'tls'}" in proc.stdout
    assert (tmp_path / "tls").stat().st_mode & 0o777 == 0o700
    plain = subprocess.run([*args, "--no-tls"], capture_output=True, text=True, timeout=120)
    assert plain.returncode == 0 and "tls" not in plain.stdout.replace("--tls-dir", ""), plain.stderr


@pytest.mark.slow  # stages a cache, maps it, trains one step: ~10 s
def test_train_sbatch_stages_remaps_and_trains(tmp_path: Path) -> None:
    """train.sbatch run as a plain script (no srun here): copy, re-map on scratch, one CPU training step."""
    from prep.cache import prepare_cache
    from prep.synth import nifti_dataset

    datalist = nifti_dataset(tmp_path / "nifti", count=2, size=48, seed=2)
    shared = tmp_path / "shared" / "cache"
    shared.parent.mkdir()
    prepare_cache(datalist, SLURM.parent / "pipelines" / "spheres.py", shared, workers=1, processes=False)
    (shared / "bmap.json").write_text("{}")  # stands for the shared copy's map: must not travel
    scratch = tmp_path / "scratch"
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "HOME": str(tmp_path), "SHARED_CACHE": str(shared),
        "SCRATCH_DIR": str(scratch), "DEVICE": "cpu", "ITERS": "1", "BATCHSIZE": "1", "PYTHON": sys.executable,
        "TRAIN_ARGS": "--channels 4 8 --workers 0", "LOADER": "all", "KEEP_SCRATCH": "1", "MPS": "1",
    }  # fmt: skip
    proc = subprocess.run(["bash", str(SLURM / "train.sbatch")], capture_output=True, text=True, env=env,
                          cwd=SLURM.parents[1], timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (local,) = scratch.glob("cache-*")  # one copy per job (the script's pid outside SLURM)
    assert (local / "manifest.json").is_file() and (scratch / "persistent").is_dir()
    assert all(f"{name}: 1 steps" in proc.stdout for name in ("fast", "drop-in", "persistent")), proc.stdout
    # MPS=1: a daemon of the job's own where the driver's tools are, else one line why and training without it
    if shutil.which("nvidia-cuda-mps-control"):
        assert "MPS: a daemon of this job's own" in proc.stdout, proc.stdout
    else:
        assert "MPS=1: no MPS on" in proc.stdout and "nvidia-cuda-mps-control not found" in proc.stderr
    assert not list(scratch.glob("mps-*")), "the MPS folder is made only where a daemon starts, removed after"
    if "no block map on this scratch" not in proc.stdout:  # tmpfs scratch cannot be mapped
        from loaders.blockmap.bmap import BlockMap

        assert len(BlockMap.load(local / "bmap.json")) == len(list((local / "shards").iterdir()))


def test_train_apptainer_sbatch_runs_train_sbatch_in_the_image(tmp_path: Path) -> None:
    """train_apptainer.sbatch as a plain script with tests/standins/apptainer (no apptainer here): every python
    step of train.sbatch (block map, training) goes through `apptainer exec IMAGE python` with the venv's PATH."""
    from prep.cache import prepare_cache
    from prep.synth import nifti_dataset

    datalist = nifti_dataset(tmp_path / "nifti", count=2, size=48, seed=2)
    shared = tmp_path / "shared" / "cache"
    shared.parent.mkdir()
    prepare_cache(datalist, SLURM.parent / "pipelines" / "spheres.py", shared, workers=1, processes=False)
    image, venv, log = tmp_path / "pytorch.sif", tmp_path / "venv", tmp_path / "apptainer.log"
    image.write_bytes(b"stands for an image")
    (venv / "bin").mkdir(parents=True)  # the image's venv, made once: its python is this one (has blockprep)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".installed").touch()
    env = {
        "PATH": f"{SLURM.parents[1] / 'tests' / 'standins'}:/usr/bin:/bin", "HOME": str(tmp_path),
        "SHARED_CACHE": str(shared), "IMAGE": str(image), "VENV": str(venv), "APPTAINER_LOG": str(log),
        "SCRATCH_DIR": str(tmp_path / "scratch"), "DEVICE": "cpu", "ITERS": "1", "BATCHSIZE": "1",
        "TRAIN_ARGS": "--channels 4 8 --workers 0", "BLOCKPREP_SRC": str(SLURM.parents[1]),
    }  # fmt: skip
    proc = subprocess.run(["bash", str(SLURM / "train_apptainer.sbatch")], capture_output=True, text=True, env=env,
                          cwd=SLURM.parents[1], timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "fast: 1 steps" in proc.stdout and "blockprep from" in proc.stdout, proc.stdout
    ran = log.read_text()
    assert f"{image}: python -m prep bmap" in ran and f"{image}: python -m workflows.train_seg3d" in ran, ran


def test_mps_run_gives_the_command_its_daemon_or_says_why_not(tmp_path: Path) -> None:
    """`mps.sh run DIR -- CMD`: the command runs (its exit status kept) under a daemon of its own where the
    driver's tools are, else without one after one line saying why; a wrong call is a usage error."""
    script = str(SLURM / "mps.sh")
    show = 'echo "pipe=${CUDA_MPS_PIPE_DIRECTORY:-none}"; exit 3'
    proc = subprocess.run(["bash", script, "run", str(tmp_path / "mps"), "--", "bash", "-c", show],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 3, proc.stderr
    if shutil.which("nvidia-cuda-mps-control"):
        assert f"pipe={tmp_path / 'mps' / 'pipe'}" in proc.stdout
    else:
        assert "pipe=none" in proc.stdout
        assert proc.stderr.splitlines() == [
            "mps.sh: nvidia-cuda-mps-control not found (it comes with the NVIDIA driver's utilities); no MPS",
            "mps.sh: running without MPS",
        ]
        assert not (tmp_path / "mps").exists()  # nothing made where no daemon started
    for wrong in (["run", str(tmp_path)], ["stop", str(tmp_path), "x"], ["start"], ["go", str(tmp_path)]):
        bad = subprocess.run(["bash", script, *wrong], capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and bad.stderr.startswith("usage: mps.sh"), wrong
