"""train_seg3d stops on SIGUSR1 at a step boundary, saves a checkpoint and resumes from it: with the fast
loader (PreparedLoader.state_dict) every loss of the resumed run equals the uninterrupted run's, bit for bit."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from clusterutil import subprocess_env, wait_for_text

from workflows import resume, train_seg3d

ITERS = 40  # batch 1 over 24 items: the run crosses an epoch boundary after the resume


def train_args(cache: Path, checkpoint: Path | None, report: Path) -> list[str]:
    args = ["--cache", str(cache), "--iters", str(ITERS), "--batchsize", "1", "--channels", "4,8", "--workers", "0",
            "--log-every", "1", "--json", str(report)]  # fmt: skip
    return args + (["--checkpoint", str(checkpoint)] if checkpoint else [])


def _losses(report: Path) -> list[float]:
    return [float(x) for x in json.loads(report.read_text())[0]["losses"]]


@pytest.mark.slow  # three short CPU trainings in subprocesses
def test_sigusr1_saves_at_a_step_and_the_resumed_run_gives_the_same_losses(epoch_cache: Path, tmp_path: Path) -> None:
    trainer = [sys.executable, "-m", "workflows.train_seg3d"]  # one torch thread, as the runs below
    subprocess.run([*trainer, *train_args(epoch_cache, None, tmp_path / "base.json")], check=True, timeout=300,
                   capture_output=True, env=subprocess_env())  # fmt: skip
    base = _losses(tmp_path / "base.json")
    ckpt, log = tmp_path / "run.ckpt", tmp_path / "run.log"
    cmd = [*trainer, *train_args(epoch_cache, ckpt, tmp_path / "run.json")]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=subprocess_env())
        try:
            wait_for_text(log, "step 3/", lambda: proc.poll() is None)
            proc.send_signal(signal.SIGUSR1)
            assert proc.wait(300) == resume.REQUEUE_EXIT, log.read_text()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    saved = resume.load(ckpt, {})
    step, state = saved["step"], saved["loader_state"]
    assert 3 <= step < ITERS and state["epoch"] == 0 and state["batch"] == step, (step, state)  # mid-epoch
    assert f"checkpoint saved at step {step}, epoch 0 batch {step}" in log.read_text()
    json.dumps(state)  # the loader's state is plain JSON
    proc2 = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert proc2.returncode == 0 and f"resumed from {ckpt} at step {step}" in proc2.stdout, proc2.stdout + proc2.stderr
    assert _losses(tmp_path / "run.json") == base and len(base) == ITERS
    assert json.loads((tmp_path / "run.json").read_text())[0]["resumed_at"] == step


def test_a_checkpoint_of_other_settings_is_refused_in_one_line(
    epoch_cache: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = tmp_path / "run.ckpt"
    resume.save(ckpt, {"settings": {"loader": "fast", "seed": 0, "batchsize": 2, "channels": [4, 8], "lr": 1e-3}})
    assert not list(tmp_path.glob(".*.tmp"))  # written by rename: no temporary file left
    with pytest.raises(SystemExit) as exc:
        train_seg3d.main(train_args(epoch_cache, ckpt, tmp_path / "r.json"))
    assert exc.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "batchsize 2 -> 1" in err and "remove it to start over" in err, err
    with pytest.raises(SystemExit) as exc:  # three loaders one after the other: nothing to resume to
        train_seg3d.parse(["--cache", str(epoch_cache), "--loader", "all", "--checkpoint", str(ckpt)])
    assert exc.value.code == 2
