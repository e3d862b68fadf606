from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from prep import synth
from prep.errors import UsageError


def test_nifti_dataset_is_deterministic_and_well_formed(tmp_path: Path) -> None:
    a = synth.nifti_dataset(tmp_path / "a", count=2, size=16, seed=5)
    b = synth.nifti_dataset(tmp_path / "b", count=2, size=16, seed=5)
    doc = json.loads(a.read_text())
    assert len(doc["training"]) == 2
    first = doc["training"][0]
    img_a = nib.load(a.parent / first["image"])
    img_b = nib.load(b.parent / first["image"])
    lab = np.asarray(nib.load(a.parent / first["label"]).dataobj)
    assert img_a.shape == (16, 16, 16)
    assert np.array_equal(img_a.get_fdata(), img_b.get_fdata())
    assert lab.dtype == np.uint8 and set(np.unique(lab)) <= {0, 1} and lab.sum() > 0


def test_image_tree_layout(tmp_path: Path) -> None:
    train = synth.image_tree(tmp_path / "t", classes=2, per_class=3, size=16)
    files = sorted(p.relative_to(train).as_posix() for p in train.rglob("*.JPEG"))
    assert len(files) == 6
    assert files[0].startswith("n00000000/")


@pytest.mark.parametrize("count", [0, -1])
def test_bad_count(tmp_path: Path, count: int) -> None:
    with pytest.raises(UsageError, match="--count"):
        synth.nifti_dataset(tmp_path / "x", count=count, size=16)


def test_missing_parent(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="does not exist"):
        synth.nifti_dataset(tmp_path / "no" / "x", count=1, size=16)


def test_existing_dataset_refused_then_replaced_with_force(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from prep.cli import app

    out = tmp_path / "d"
    runner = CliRunner()
    assert runner.invoke(app, ["synth", "nifti", str(out), "--count", "3", "--size", "8"]).exit_code == 0
    before = (out / "dataset.json").read_bytes()
    result = runner.invoke(app, ["synth", "nifti", str(out), "--count", "2", "--size", "8"])
    assert result.exit_code == 1 and "already holds a dataset" in result.output and "--force" in result.output
    assert (out / "dataset.json").read_bytes() == before and len(list((out / "imagesTr").iterdir())) == 3
    result = runner.invoke(app, ["synth", "nifti", str(out), "--count", "2", "--size", "8", "--force"])
    assert result.exit_code == 0, result.output
    assert len(list((out / "imagesTr").iterdir())) == 2  # no orphan from the first dataset
    images = ["synth", "images", str(tmp_path / "i"), "--classes", "1", "--per-class", "1"]
    assert runner.invoke(app, images).exit_code == 0
    result = runner.invoke(app, images)
    assert result.exit_code == 1 and "already holds a dataset (train)" in result.output
