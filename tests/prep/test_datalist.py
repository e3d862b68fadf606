"""prep's datalist reading against MONAI's own `load_decathlon_datalist`: segmentation datalists (label files)
and classification datalists (class names as labels) read as the user's MONAI loading reads them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("monai")

from prep.datalist import load_datalist  # noqa: E402


def _write(root: Path, entries: list[dict]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    path = root / "dataset.json"
    path.write_text(json.dumps({"training": entries}))
    return path


def _monai(path: Path, seg: bool) -> list[dict]:
    from monai.data import load_decathlon_datalist

    return [dict(e) for e in load_decathlon_datalist(str(path), is_segmentation=seg, data_list_key="training")]


def test_class_names_stay_names_as_monai_reads_a_classification_list(tmp_path: Path) -> None:
    for name in ("a.png", "b.png"):
        (tmp_path / name).write_bytes(b"")
    path = _write(tmp_path, [{"image": "a.png", "label": "Hand", "modality": "CT"},
                             {"image": "b.png", "label": "CT", "modality": "CT"}])  # fmt: skip
    got = [e for _, e in load_datalist(path)]
    assert got == _monai(path, seg=False)
    assert [e["label"] for e in got] == ["Hand", "CT"] and got[0]["image"] == str(tmp_path / "a.png")
    assert got != _monai(path, seg=True)  # negative control: read as segmentation, "Hand" became a path


def test_label_files_are_joined_as_monai_joins_a_segmentation_list(tmp_path: Path) -> None:
    for name in ("a.nii.gz", "la.nii.gz", "b.nii.gz"):
        (tmp_path / name).write_bytes(b"")
    path = _write(
        tmp_path, [{"image": "a.nii.gz", "label": "la.nii.gz"}, {"image": "b.nii.gz", "label": "lb.nii.gz"}]
    )  # lb missing: still a path, said later
    got = [e for _, e in load_datalist(path)]
    assert got == _monai(path, seg=True) and got[1]["label"] == str(tmp_path / "lb.nii.gz")


def test_int_labels_unchanged(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"")
    path = _write(tmp_path, [{"image": "a.png", "label": 3}])
    assert [e for _, e in load_datalist(path)] == _monai(path, seg=True) == _monai(path, seg=False)


def test_a_prepared_class_name_comes_back_as_written(tmp_path: Path) -> None:
    import nibabel as nib

    from loaders.fast.loader import PreparedLoader
    from prep.cache import prepare_cache

    entries = []
    for i, label in enumerate(["Hand", "CT", "Hand"]):
        nib.save(nib.Nifti1Image(np.full((6, 5), i, np.float32), np.eye(4)), tmp_path / f"im{i}.nii.gz")
        entries.append({"image": f"im{i}.nii.gz", "label": label})
    path = _write(tmp_path, entries)
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(
        "from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandFlipd\n"
        "transform = Compose([LoadImaged(keys='image'), EnsureChannelFirstd(keys='image'),\n"
        "                     RandFlipd(keys='image', prob=0.5)])\n"
    )
    prepare_cache(path, pipeline, tmp_path / "cache", workers=1)
    from prep.pipeline import load_pipeline

    loader = PreparedLoader(tmp_path / "cache", load_pipeline(pipeline).transform, batch_size=3, device="cpu",
                            shuffle=False)  # fmt: skip
    (batch,) = list(loader)
    loader.close()
    assert batch["label"] == ["Hand", "CT", "Hand"]
