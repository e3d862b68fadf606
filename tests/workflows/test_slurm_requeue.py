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
CPU_NODE = ("--gres=none", "--mem=2G", "--cpus-per-task=1")
ITERS = 40
TRAIN = ["--channels", "4,8", "--workers", "0", "--log-every", "1"]


def test_the_sbatch_asks_for_the_warning_signal_and_requeue() -> None:
    text = SBATCH.read_text()
    for line in ("#SBATCH --signal=B:USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append"):
        assert re.search(rf"^{re.escape(line)}$", text, re.M), line


def test_a_job_signalled_mid_epoch_requeues_and_resumes_with_the_same_losses(
    slurm: SlurmCluster, epoch_cache: Path, tmp_path: Path
) -> None:
    base = tmp_path / "base.json"
    subprocess.run([sys.executable, "-m", "workflows.train_seg3d", "--cache", str(epoch_cache), "--iters", str(ITERS),
                    "--batchsize", "1", *TRAIN, "--json", str(base)],
                   check=True, capture_output=True, timeout=300, env=subprocess_env())  # fmt: skip
    env = slurm.env(**{**subprocess_env(), "SLURM_CONF": str(slurm.conf), "HOME": str(tmp_path), "DEVICE": "cpu",
                       "PYTHON": sys.executable, "LOADER": "fast", "SCRATCH_DIR": str(tmp_path / "scratch"),
                       "TRAIN_ARGS": " ".join([*TRAIN, "--json", str(tmp_path / "job.json")])})  # fmt: skip
    job = slurm.sbatch(*CPU_NODE, f"--export=ALL,SHARED_CACHE={epoch_cache},ITERS={ITERS},BATCHSIZE=1", str(SBATCH),
                       env=env, cwd=tmp_path)  # fmt: skip
    log = tmp_path / f"blockprep-train-{job}.out"
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
    assert f"resumed from {tmp_path / f'blockprep-train-{job}.ckpt'} at step {step}" in out, out
    (report,) = json.loads((tmp_path / "job.json").read_text())
    assert report["resumed_at"] == step and report["losses"] == json.loads(base.read_text())[0]["losses"]
    assert not (tmp_path / "scratch" / f"cache-{job}").exists()  # each run's staged copy removed


def _start_now_once_pending(slurm: SlurmCluster, job: int, timeout: float = 120.0) -> None:
    """slurmctld gives a requeued job a begin time in the future (Reason=BeginTime): start it now instead."""
    deadline = time.monotonic() + timeout
    while slurm.state(job) != "PENDING":
        assert time.monotonic() < deadline and slurm.state(job) not in DONE_STATES, slurm.state(job)
        time.sleep(0.1)
    print(slurm.run("scontrol", "show", "job", str(job)))  # shown on failure: the requeued job's reason
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
