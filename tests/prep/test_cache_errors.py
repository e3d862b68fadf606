"""prep cache errors a user meets: one line, exit 1, nothing lost (read-only mounts, a file as --output, a
full disk under dask, a non-image file in a datalist entry)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cacheutil import REPO, SPHERES
from typer.testing import CliRunner

from loaders.cache.format import PreparedCache
from prep.cache import prepare_cache
from prep.cli import app


def _cache_args(datalist: Path, out: Path, *extra: str, pipeline: Path = SPHERES) -> list[str]:
    return ["cache", str(datalist), "--pipeline", str(pipeline), "--output", str(out), "--workers", "1", *extra]


def _one_error_line(result: object, *needles: str) -> None:
    output = result.output  # type: ignore[attr-defined]
    assert result.exit_code == 1, output  # type: ignore[attr-defined]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in output, output
    for needle in needles:
        assert needle in errors[0], output


@pytest.mark.loopdev
def test_read_only_mount(tmp_path: Path, nifti_dataset: Path, make_loopfs: object) -> None:
    fs = make_loopfs("ext4", size_mb=16)  # type: ignore[operator]
    out = fs.mountpoint / "cache"
    runner = CliRunner()
    assert runner.invoke(app, _cache_args(nifti_dataset, out)).exit_code == 0
    subprocess.run(["mount", "-o", "remount,ro", str(fs.mountpoint)], check=True)
    result = runner.invoke(app, _cache_args(nifti_dataset, out))  # complete: no lock needed to say so
    assert result.exit_code == 0, result.output
    assert "already complete and up to date" in result.output
    _one_error_line(runner.invoke(app, _cache_args(nifti_dataset, out, "--force")), "cannot write here")
    other = tmp_path / "other.py"
    other.write_text(SPHERES.read_text().replace("pixdim=(1.0, 1.0, 1.0)", "pixdim=(2.0, 2.0, 2.0)"))
    _one_error_line(runner.invoke(app, _cache_args(nifti_dataset, out, pipeline=other)), "pipeline head")
    new = fs.mountpoint / "new"
    _one_error_line(runner.invoke(app, _cache_args(nifti_dataset, new)), "cannot create the cache folder", "Read-only")
    assert PreparedCache(out).n_items == 6


def test_output_naming_a_file(tmp_path: Path, nifti_dataset: Path) -> None:
    (tmp_path / "afile").write_text("precious")
    _one_error_line(CliRunner().invoke(app, _cache_args(nifti_dataset, tmp_path / "afile")), "is a file")
    assert (tmp_path / "afile").read_text() == "precious"


@pytest.mark.loopdev
def test_disk_full_prints_no_dask_traceback(tmp_path: Path, nifti_dataset: Path, make_loopfs: object) -> None:
    fs = make_loopfs("ext4", size_mb=8)  # type: ignore[operator]
    with open(fs.mountpoint / "filler", "wb") as f:
        f.write(b"\0" * max(0, shutil.disk_usage(fs.mountpoint).free - 600_000))
        os.fsync(f.fileno())
    out = fs.mountpoint / "cache"
    proc = subprocess.run(
        [sys.executable, "-m", "prep", *_cache_args(nifti_dataset, out)],
        capture_output=True, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Compute Failed" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "no space left" in errors[0], proc.stderr


def test_non_image_file_quarantined_under_its_own_path(tmp_path: Path) -> None:
    from prep.synth import nifti_dataset

    datalist = nifti_dataset(tmp_path / "data", count=2, size=16, seed=3)
    (tmp_path / "data" / "notes.txt").write_text("not an image")
    doc = json.loads(datalist.read_text())
    doc["training"].append({"image": "notes.txt", "label": "labelsTr/case_00000.nii.gz"})
    datalist.write_text(json.dumps(doc))
    out = tmp_path / "cache"
    summary = prepare_cache(datalist, SPHERES, out, workers=1)
    assert [Path(q["path"]).name for q in summary.quarantined] == ["notes.txt"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quarantined"][0]["path"] == str(tmp_path / "data" / "notes.txt")
    assert ": 3 items: 2 cached, 1 quarantined; 3 processed in this run (" in summary.lines()[0]


@pytest.mark.parametrize(
    ("training", "needle"),
    [({"case": {"image": "a.nii.gz"}}, "is a dict, not a list"), (["a.nii.gz", "b.nii.gz"], "entry 0 of 'training'")],
)
def test_training_section_of_the_wrong_shape(tmp_path: Path, training: object, needle: str) -> None:
    datalist = tmp_path / "dataset.json"
    datalist.write_text(json.dumps({"training": training}))
    _one_error_line(CliRunner().invoke(app, _cache_args(datalist, tmp_path / "cache")), needle, "write it as")
    assert not (tmp_path / "cache" / "manifest.json").exists()


def test_empty_training_list(tmp_path: Path) -> None:
    datalist = tmp_path / "dataset.json"
    datalist.write_text(json.dumps({"training": []}))
    _one_error_line(CliRunner().invoke(app, _cache_args(datalist, tmp_path / "cache")), "'training' is empty")
    assert not (tmp_path / "cache" / "manifest.json").exists()


def test_rerun_with_a_shard_deleted(tmp_path: Path, nifti_dataset: Path) -> None:
    out = tmp_path / "cache"
    runner = CliRunner()
    assert runner.invoke(app, _cache_args(nifti_dataset, out)).exit_code == 0
    shard = sorted((out / "shards").iterdir())[0]
    shard.unlink()
    _one_error_line(runner.invoke(app, _cache_args(nifti_dataset, out)), f"shard {shard.name} is missing", "--force")
    rebuilt = runner.invoke(app, _cache_args(nifti_dataset, out, "--force"))
    assert rebuilt.exit_code == 0, rebuilt.output
    assert PreparedCache(out).n_items == 6


def test_first_transform_random_prepares_nothing(tmp_path: Path, nifti_dataset: Path) -> None:
    pipe = tmp_path / "random_first.py"
    pipe.write_text(
        "from monai.transforms import Compose, LoadImaged, RandFlipd\n"
        "transform = Compose([RandFlipd(keys=['image'], prob=0.5), LoadImaged(keys=['image', 'label'])])\n"
    )
    out = tmp_path / "cache"
    runner = CliRunner()
    _one_error_line(runner.invoke(app, _cache_args(nifti_dataset, out, pipeline=pipe)), "nothing to prepare",
                    "RandFlipd", "--allow-empty-head")  # fmt: skip
    assert not (out / "manifest.json").exists()
    allowed = runner.invoke(app, _cache_args(nifti_dataset, out, "--allow-empty-head", pipeline=pipe))
    assert allowed.exit_code == 0, allowed.output
    assert PreparedCache(out).n_items == 6 and PreparedCache(out).manifest["keys"] == []


def test_zeroed_shard_rerun_says_what_was_checked(tmp_path: Path, nifti_dataset: Path) -> None:
    out = tmp_path / "cache"
    runner = CliRunner()
    assert runner.invoke(app, _cache_args(nifti_dataset, out)).exit_code == 0
    shard = sorted((out / "shards").iterdir())[0]
    shard.write_bytes(bytes(shard.stat().st_size))
    rerun = runner.invoke(app, _cache_args(nifti_dataset, out))
    assert rerun.exit_code == 0, rerun.output
    assert "already complete and up to date" in rerun.output
    assert "tensor bytes not re-read: `prep verify` checks them" in rerun.output, rerun.output
    verify = runner.invoke(app, ["verify", str(out)])
    assert verify.exit_code == 1 and "bad tensors" in verify.output, verify.output
    checked = runner.invoke(app, _cache_args(nifti_dataset, out, "--verify"))
    assert "not re-read" not in checked.output and "verify: " in checked.output, checked.output


def _journaled(out: Path) -> int:
    return sum(len(p.read_text().splitlines()) for p in (out / "journal").glob("*.jsonl"))


def _xxh3_per_item(root: Path) -> list[list[int]]:
    cache = PreparedCache(root)
    return [sorted(e.xxh3 for e in cache.entries(i)) for i in range(cache.n_items)]


def _slow_at_the_end(root: Path, nifti_dataset: Any) -> Path:
    """Four small items, then twelve larger ones: the run is still busy when its first items are journaled (24 small
    ones could all be done before two Ctrl-Cs reached it on a loaded machine)."""
    datalist = nifti_dataset(root / "data", count=4, size=40, seed=5)
    big = nifti_dataset(root / "big", count=12, size=96, seed=6)
    doc = json.loads(datalist.read_text())
    for entry in json.loads(big.read_text())["training"]:
        for key, rel in entry.items():
            moved = f"{Path(rel).parent}/big_{Path(rel).name}"
            (root / "big" / rel).rename(root / "data" / moved)
            entry[key] = moved
        doc["training"].append(entry)
    doc["numTraining"] = len(doc["training"])
    datalist.write_text(json.dumps(doc))
    return datalist


@pytest.mark.parametrize("mode", ["--threads", "--processes"])
def test_double_ctrl_c_exits_at_once_with_one_line_and_resumes(tmp_path: Path, mode: str) -> None:
    """Two SIGINTs to the process group (a terminal's Ctrl-C reaches the dask worker processes too)."""
    import signal
    import time

    from prep.synth import nifti_dataset

    datalist = _slow_at_the_end(tmp_path, nifti_dataset)
    out = tmp_path / "cache"
    cmd = [sys.executable, "-m", "prep", *_cache_args(datalist, out, mode)]
    cmd[cmd.index("--workers") + 1] = "2"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        while proc.poll() is None and not ((out / "journal").is_dir() and _journaled(out)):
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, signal.SIGINT)
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)  # a hang guard, not a timing
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "CancelledError" not in stderr, stderr
    assert len([line for line in stderr.splitlines() if line.startswith("interrupted")]) == 1, stderr
    assert not (out / "manifest.json").exists()
    summary = prepare_cache(datalist, SPHERES, out, workers=2, processes=False)
    assert summary.n_resumed > 0 and summary.n_items == 16
    # the resumed items' sampling sets were not made by this run's workers: made from the cache after it
    assert summary.sampling.startswith("sampling sets: 16 items") and "by the workers" not in summary.sampling
    clean = prepare_cache(datalist, SPHERES, tmp_path / "clean", workers=1, processes=False)
    assert clean.n_items == 16 and _xxh3_per_item(out) == _xxh3_per_item(tmp_path / "clean")
