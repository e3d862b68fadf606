"""The SLURM templates run for real: sbatch on a one-node cluster on localhost (see tests/slurmcluster.py).

Jobs ask for what this CPU node has: `--gres=none --mem=2G --cpus-per-task=1` override the templates'
GPU-node directives on the command line, as a user of a CPU partition would.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from cacheutil import REPO, SPHERES
from clusterutil import assert_same_cache, subprocess_env
from slurmcluster import SlurmCluster

from prep.cache import prepare_cache
from prep.synth import nifti_dataset

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
SLURM = REPO / "workflows" / "slurm"
CPU_NODE = ("--gres=none", "--mem=2G", "--cpus-per-task=1")


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small prepared cache standing for the copy on shared storage."""
    root = tmp_path_factory.mktemp("shared")
    datalist = nifti_dataset(root / "nifti", count=2, size=48, seed=2)
    prepare_cache(datalist, SPHERES, root / "cache", workers=1, processes=False)
    (root / "cache" / "bmap.json").write_text("{}")  # the shared copy's map: stale on the node, must not travel
    return root / "cache"


def _job_env(slurm: SlurmCluster, tmp: Path, **extra: str) -> dict[str, str]:
    return slurm.env(**{**subprocess_env(), "SLURM_CONF": str(slurm.conf), "HOME": str(tmp), "DEVICE": "cpu",
                        "PYTHON": sys.executable, "TRAIN_ARGS": "--channels 4 8 --workers 0", **extra})  # fmt: skip


def _output(workdir: Path, name: str, job: int) -> str:
    return (workdir / f"{name}-{job}.out").read_text(errors="replace")


@pytest.mark.parametrize("scratch_kind", ["folder", pytest.param("mountpoint", marks=pytest.mark.loopdev)])
def test_train_sbatch_stages_remaps_and_trains(
    slurm: SlurmCluster, shared_cache: Path, tmp_path: Path, scratch_kind: str, request: pytest.FixtureRequest
) -> None:
    """sbatch train.sbatch: copy to scratch, `prep bmap` there, verify, one CPU training step, clean up."""
    if scratch_kind == "mountpoint":  # scratch is its own filesystem: mapped at its mountpoint
        scratch = request.getfixturevalue("make_loopfs")("ext4", size_mb=64).mountpoint
    else:  # scratch is a folder of a larger filesystem: the cache folder itself is mapped
        scratch = tmp_path / "scratch"
    keep = "1" if scratch_kind == "mountpoint" else "0"
    env = _job_env(slurm, tmp_path, SCRATCH_DIR=str(scratch), KEEP_SCRATCH=keep, VERIFY="1", LOADER="all",
                   MPS="1", BLOCKPREP_SRC=str(SLURM.parents[1]))  # fmt: skip
    job = slurm.sbatch(*CPU_NODE, f"--export=ALL,SHARED_CACHE={shared_cache},ITERS=1,BATCHSIZE=1",
                       str(SLURM / "train.sbatch"), env=env, cwd=tmp_path)  # fmt: skip
    state = slurm.wait([job])[job]
    out = _output(tmp_path, "blockprep-train", job)
    assert state == "COMPLETED", out + slurm.logs()
    assert f"staging {shared_cache} -> {scratch / f'cache-{job}'}" in out  # one copy per job
    assert re.search(r"\d+ files, \d+ bytes, \d+ extents", out) and "no block map on this scratch" not in out, out
    assert "every tensor verified" in out
    assert all(f"{name}: 1 steps" in out for name in ("fast", "drop-in", "persistent")), out
    # MPS=1 from a job's spooled copy of the script: mps.sh found in the checkout, a daemon or one line why not
    assert "MPS: a daemon of this job's own" in out or "MPS=1: no MPS on" in out, out
    assert not list(Path(scratch).glob("mps-*"))
    local = scratch / f"cache-{job}"
    if keep == "1":
        from loaders.blockmap.bmap import BlockMap
        from prep.cache_verify import verify_cache

        assert len(BlockMap.load(local / "bmap.json")) == len(list((local / "shards").iterdir()))
        assert verify_cache(local) == []
    else:
        assert not local.exists() and not (scratch / "persistent").exists()


def test_sweep_submits_one_job_per_setting_and_each_runs(
    slurm: SlurmCluster, shared_cache: Path, tmp_path: Path
) -> None:
    env = _job_env(slurm, tmp_path, SHARED_CACHE=str(shared_cache), SCRATCH_DIR=str(tmp_path / "scratch"),
                   BACKENDS="posix direct", BATCHSIZES="1", ITERS="1", SBATCH_ARGS=" ".join(CPU_NODE))  # fmt: skip
    proc = subprocess.run(["bash", str(SLURM / "sweep.sh")], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    jobs = [int(line.split(";")[0]) for line in proc.stdout.split()]
    assert len(jobs) == 2
    states = slurm.wait(jobs)
    for job, backend in zip(jobs, ("posix", "direct")):
        out = _output(tmp_path, f"bp-fast-{backend}-b1", job)
        assert states[job] == "COMPLETED", out
        assert f"loader=fast backend={backend} batchsize=1 iters=1 device=cpu" in out, out
        assert "fast: 1 steps" in out, out


def test_jobqueue_recipe_prepares_the_local_cache_over_tls(
    slurm: SlurmCluster, tmp_path: Path, nifti_dataset: Path
) -> None:
    """prep_cache_jobqueue.py on a dask-jobqueue SLURMCluster (TLS by default): the same cache as a local run."""
    pytest.importorskip("dask_jobqueue", reason="pip install 'blockprep[slurm]'")
    pytest.importorskip("cryptography", reason="pip install 'blockprep[slurm]'")
    local = tmp_path / "local"
    prepare_cache(nifti_dataset, SPHERES, local, workers=1, processes=False)
    env = _job_env(slurm, tmp_path)
    args = [sys.executable, str(SLURM / "prep_cache_jobqueue.py"), str(nifti_dataset), "--pipeline", str(SPHERES),
            "--output", str(tmp_path / "remote"), "--jobs", "1", "--cores", "1", "--memory", "2GB",
            "--walltime", "00:15:00", "--tls-dir", str(tmp_path / "tls"), "--timeout", "300"]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr + slurm.logs()
    assert re.search(r"scheduler at tls://", proc.stdout), proc.stdout
    assert "6 items: 6 cached" in proc.stdout, proc.stdout
    assert_same_cache(local, tmp_path / "remote")
    # the worker job ran under SLURM and was cancelled when the recipe closed its cluster
    assert not slurm.run("squeue", "-h").strip()
