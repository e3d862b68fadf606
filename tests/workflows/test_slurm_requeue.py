"""train.sbatch under a time limit's warning, for real on the one-node cluster (tests/slurmcluster.py): the
batch script gets USR1 (what `#SBATCH --signal=B:USR1@120` sends; here `scancel --signal=USR1 --batch`,
so the moment is mid-epoch), the training saves its checkpoint at the next step, the job requeues itself,
resumes, and every per-step loss equals an uninterrupted run's on the same cache."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clusterutil import subprocess_env, wait_for_text
from slurmcluster import DONE_STATES, SlurmCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "workflows" / "slurm" / "train.sbatch"
APPTAINER = REPO / "workflows" / "slurm" / "train_apptainer.sbatch"
CPU_NODE = ("--gres=none", "--mem=2G", "--cpus-per-task=1")
ITERS = 40
TRAIN = ["--channels", "4,8", "--workers", "0", "--log-every", "1"]


@pytest.mark.parametrize("script", [SBATCH, APPTAINER], ids=lambda p: p.name)
def test_the_sbatch_asks_for_the_warning_signal_and_requeue(script: Path) -> None:
    text = script.read_text()
    for line in ("#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert re.search(rf"^{re.escape(line)}$", text, re.M), line


@pytest.mark.parametrize("script", [SBATCH, APPTAINER], ids=lambda p: p.name)
def test_a_job_signalled_mid_epoch_requeues_and_resumes_with_the_same_losses(
    slurm: SlurmCluster, epoch_cache: Path, tmp_path: Path, script: Path
) -> None:
    """train_apptainer.sbatch runs with tests/standins/apptainer (no apptainer here): the signal goes through
    its exec into train.sbatch, and every python step through python_in_image.sh."""
    base = tmp_path / "base.json"
    subprocess.run([sys.executable, "-m", "workflows.train_seg3d", "--cache", str(epoch_cache), "--iters", str(ITERS),
                    "--batchsize", "1", *TRAIN, "--json", str(base)],
                   check=True, capture_output=True, timeout=300, env=subprocess_env())  # fmt: skip
    env = slurm.env(**{**subprocess_env(), "SLURM_CONF": str(slurm.conf), "HOME": str(tmp_path), "DEVICE": "cpu",
                       "PYTHON": sys.executable, "LOADER": "fast", "SCRATCH_DIR": str(tmp_path / "scratch"),
                       "TRAIN_ARGS": " ".join([*TRAIN, "--json", str(tmp_path / "job.json")])})  # fmt: skip
    if script == APPTAINER:
        env.update(_image(tmp_path), PATH=f"{REPO / 'tests' / 'standins'}:{env.get('PATH', '/usr/bin:/bin')}")
    job = slurm.sbatch(*CPU_NODE, f"--export=ALL,SHARED_CACHE={epoch_cache},ITERS={ITERS},BATCHSIZE=1", str(script),
                       env=env, cwd=tmp_path)  # fmt: skip
    name = "blockprep-train-apptainer" if script == APPTAINER else "blockprep-train"
    log = tmp_path / f"{name}-{job}.out"
    wait_for_text(log, "step 3/", lambda: slurm.state(job) in {"PENDING", "CONFIGURING", "RUNNING"})
    slurm.run("scancel", "--signal=USR1", "--batch", str(job))
    wait_for_text(log, "requeueing job", lambda: slurm.state(job) in {"RUNNING", "COMPLETING", "PENDING"})
    _start_now_once_pending(slurm, job)
    state = slurm.wait([job])[job]
    out = log.read_text(errors="replace")
    assert state == "COMPLETED", out + slurm.logs()
    assert re.search(r"Restarts=1\b", slurm.run("scontrol", "show", "job", str(job))), out
    saved = re.search(r"checkpoint saved at step (\d+), epoch 0 batch (\d+)", out)
    assert saved and 3 <= int(saved[1]) == int(saved[2]) < ITERS, out  # mid-epoch: 24 batches an epoch
    step = int(saved[1])
    assert f"requeueing job {job}" in out and f"run 1 of job {job}" in out, out
    assert f"resumed from {tmp_path / f'{name}-{job}.ckpt'} at step {step}" in out, out
    (report,) = json.loads((tmp_path / "job.json").read_text())
    assert report["resumed_at"] == step and report["losses"] == json.loads(base.read_text())[0]["losses"]
    assert not (tmp_path / "scratch" / f"cache-{job}").exists()  # each run's staged copy removed


def _image(tmp_path: Path) -> dict[str, str]:
    """An image file and a venv made once, whose python is this one (it has blockprep), for the stand-in."""
    image, venv = tmp_path / "pytorch.sif", tmp_path / "venv"
    image.write_bytes(b"stands for an image")
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".installed").touch()
    return {
        "IMAGE": str(image),
        "VENV": str(venv),
        "BLOCKPREP_SRC": str(REPO),
        "APPTAINER_LOG": str(tmp_path / "a.log"),
    }


def _start_now_once_pending(slurm: SlurmCluster, job: int, timeout: float = 120.0) -> None:
    """slurmctld gives a requeued job a begin time in the future (Reason=BeginTime): start it now instead."""
    deadline = time.monotonic() + timeout
    while slurm.state(job) != "PENDING":
        assert time.monotonic() < deadline and slurm.state(job) not in DONE_STATES, slurm.state(job)
        time.sleep(0.1)
    print(slurm.run("scontrol", "show", "job", str(job)))  # shown on failure: the requeued job's reason
    # slurmd refuses a credential made in the same second as the requeue revoked the job's ("Job credential
    # revoked"): its times are whole seconds
    time.sleep(2.0)
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
