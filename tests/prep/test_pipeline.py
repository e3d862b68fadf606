"""prep.pipeline: PIPELINE.py and bundle configs load, split and fingerprint the same; bad files say why."""

from __future__ import annotations

from pathlib import Path

import pytest
from cacheutil import REPO, SPHERES

from prep.errors import UsageError
from prep.pipeline import load_pipeline

BUNDLE = REPO / "workflows" / "pipelines" / "spheres_bundle.yaml"


def test_python_and_bundle_forms_agree() -> None:
    py = load_pipeline(SPHERES)
    bundle = load_pipeline(BUNDLE, "preprocessing")
    assert [type(t).__name__ for t in py.head] == [
        "LoadImaged",
        "EnsureChannelFirstd",
        "Spacingd",
        "ScaleIntensityRanged",
    ]
    assert [type(t).__name__ for t in py.tail] == ["RandCropByPosNegLabeld", "RandFlipd"]
    assert py.fingerprint == bundle.fingerprint
    assert py.head_description == bundle.head_description and py.tail_description == bundle.tail_description
    assert load_pipeline(BUNDLE).bundle_key == "preprocessing"  # the default key


def test_changed_setting_changes_fingerprint(tmp_path: Path) -> None:
    changed = tmp_path / "p.py"
    changed.write_text(SPHERES.read_text().replace("a_max=1000.0", "a_max=999.0"))
    assert load_pipeline(changed).fingerprint != load_pipeline(SPHERES).fingerprint
    tail_only = tmp_path / "t.py"
    tail_only.write_text(SPHERES.read_text().replace("prob=0.5", "prob=0.9"))
    assert load_pipeline(tail_only).fingerprint == load_pipeline(SPHERES).fingerprint  # the tail is not cached


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("x = 1\n", "defines no `transform`"),
        ("transform = 3\n", "not a monai Compose"),
        ("raise RuntimeError('boom')\n", "failed to run.*boom"),
        (
            "from monai.transforms import Compose, LoadImage\ntransform = Compose([LoadImage()])\n",
            r"LoadImage\) is an array transform; use dictionary transforms \(LoadImaged\)",
        ),
        (
            "from monai.transforms import Compose, OneOf, RandFlipd, ScaleIntensity\n"
            "transform = Compose([RandFlipd(keys='x'), OneOf([RandFlipd(keys='x'), ScaleIntensity()])])\n",
            r"transform 1 \(OneOf\) > 1 \(ScaleIntensity\) is an array transform",
        ),
    ],
)
def test_bad_pipeline_files(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "p.py"
    path.write_text(text)
    with pytest.raises(UsageError, match=match):
        load_pipeline(path)


def test_missing_file_and_bundle_key(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="pipeline file not found"):
        load_pipeline(tmp_path / "nope.py")
    with pytest.raises(UsageError, match="no entry 'training'.*top-level: .*keys, patch, preprocessing"):
        load_pipeline(BUNDLE, "training")
    with pytest.raises(UsageError, match="--bundle-key applies to bundle configs"):
        load_pipeline(SPHERES, "preprocessing")
    other = tmp_path / "p.txt"
    other.write_text("")
    with pytest.raises(UsageError, match="unknown pipeline kind"):
        load_pipeline(other)


def test_head_compose_reproduces_the_chain(nifti_dataset: Path) -> None:
    import json

    import numpy as np

    pipe = load_pipeline(SPHERES)
    entry = json.loads(nifti_dataset.read_text())["training"][0]
    entry = {k: str(nifti_dataset.parent / v) for k, v in entry.items()}
    a = pipe.head_compose()(dict(entry))
    b = pipe.head_compose()(dict(entry))
    assert np.array_equal(a["image"].numpy(), b["image"].numpy())
    # the affine's voxel size: MONAI 1.4 leaves the header's meta["pixdim"] as loaded
    assert a["image"].shape[0] == 1 and np.allclose(a["image"].pixdim, 1.0)
