"""The conformance suite's data and caches: small synthetic NIfTI sets, each chain's head prepared once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("monai")


def _nifti_2d(out: Path, count: int = 5, seed: int = 4) -> Path:
    """Five 2D image/label pairs of different shapes, each with an int class and a modality string."""
    import nibabel as nib

    out.mkdir(parents=True)
    training = []
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        shape = (24 + 2 * i, 20 + i)
        image = rng.random(shape, dtype=np.float32)
        label = (image > 0.7).astype(np.uint8)
        for name, arr in (("img", image), ("lab", label)):
            nib.save(nib.Nifti1Image(arr, np.diag([0.8, 1.1, 1.0, 1.0])), out / f"{name}{i}.nii.gz")
        training.append({"image": f"img{i}.nii.gz", "label": f"lab{i}.nii.gz", "class": i % 3, "modality": "CT"})
    datalist = out / "dataset.json"
    datalist.write_text(json.dumps({"training": training}))
    return datalist


def _rings(shape: tuple[int, ...], rng: np.random.Generator, classes: int) -> np.ndarray:
    """Labels 0..classes-1 as nested shells around an off-centre point: every class in every item."""
    grid = np.indices(shape).astype(np.float32)
    centre = np.array(shape, dtype=np.float32) / 2 + rng.uniform(-1.5, 1.5, len(shape))
    r = np.sqrt(sum((g - c) ** 2 for g, c in zip(grid, centre)))
    edges = np.linspace(min(shape) * 0.42, min(shape) * 0.14, classes - 1)
    return sum((r < e).astype(np.uint8) for e in edges).astype(np.uint8)


def _multimodal(out: Path, dims: int, count: int, seed: int, ragged: bool) -> Path:
    """The held-out sets (heldout.py): other key names, two modalities, a multi-class label, flipped affines
    and per-item values of several kinds (a string, an int, a float, a list of one repeated string).
    3D: "t1" (float32), "t2" (int16), "seg" (0..3); 2D: "img" (two files, stacked as channels), "msk" (0..2)."""
    import nibabel as nib

    out.mkdir(parents=True)
    training = []
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        if dims == 3:
            shape: tuple[int, ...] = tuple(int(n) for n in rng.integers(16, 23, 3)) if ragged else (20, 20, 20)
            affine = np.diag([-1.2 if i % 2 else 1.2, 0.9, 1.5, 1.0])
        else:
            shape = (22 + i, 18 + 2 * i) if ragged else (22, 20)
            affine = np.diag([0.7, -0.9 if i % 2 else 0.9, 1.0, 1.0])
        seg = _rings(shape, rng, 4 if dims == 3 else 3)
        one = (seg * 0.25 + rng.random(shape, dtype=np.float32) * 0.5).astype(np.float32)
        two = (seg.astype(np.int16) * 300 + rng.integers(-200, 200, shape)).astype(np.int16)
        entry: dict[str, Any] = {"pid": f"case{i}", "age": 40 + i, "dose": 0.5 + i / 4, "tags": ["MR", "MR"]}
        if dims == 3:
            arrays = {"t1": one, "t2": two, "seg": seg}
            entry.update({k: f"{k}{i}.nii.gz" for k in arrays})
        else:
            arrays = {"a": one, "b": two.astype(np.float32), "msk": seg}
            entry.update({"img": [f"a{i}.nii.gz", f"b{i}.nii.gz"], "msk": f"msk{i}.nii.gz"})
        for name, arr in arrays.items():
            nib.save(nib.Nifti1Image(arr, affine), out / f"{name}{i}.nii.gz")
        training.append(entry)
    datalist = out / "dataset.json"
    datalist.write_text(json.dumps({"training": training}))
    return datalist


@pytest.fixture(scope="session")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> datalist: "3d" five 24^3 volumes, "3d-ragged" four of different shapes, "2d" five 2D slices;
    "mm3d", "mm3d-ragged", "mm2d", "mm2d-ragged" the held-out sets (`_multimodal`)."""
    from prep.synth import nifti_dataset

    root = tmp_path_factory.mktemp("conformance-data")
    return {
        "3d": nifti_dataset(root / "3d", count=5, size=24, seed=3),
        "3d-ragged": nifti_dataset(root / "ragged", count=4, size=22, seed=5, shape_range=0.2),
        "2d": _nifti_2d(root / "2d"),
        "mm3d": _multimodal(root / "mm3d", 3, count=4, seed=7, ragged=False),
        "mm3d-ragged": _multimodal(root / "mm3d-ragged", 3, count=5, seed=8, ragged=True),
        "mm2d": _multimodal(root / "mm2d", 2, count=5, seed=9, ragged=False),
        "mm2d-ragged": _multimodal(root / "mm2d-ragged", 2, count=4, seed=10, ragged=True),
    }


class Caches:
    """Each row's cache, made by `prep cache` (the function the CLI calls) on first use."""

    def __init__(self, root: Path, datasets: dict[str, Path]) -> None:
        self.root, self.datasets = root, datasets
        self.made: dict[str, Path] = {}

    def __call__(self, row: Any) -> Path:
        from prep.cache import prepare_cache

        if row.name not in self.made:
            folder = self.root / row.name
            folder.mkdir()
            pipeline = folder / "pipeline.py"
            pipeline.write_text(f"from heldout import ALL\n\ntransform = ALL[{row.name!r}].chain()\n")
            summary = prepare_cache(self.datasets[row.data], pipeline, folder / "cache", workers=1, processes=False)
            assert not summary.quarantined, (row.name, summary.quarantined)  # every item, or the row proves nothing
            self.made[row.name] = folder / "cache"
        return self.made[row.name]

    def data(self, row: Any) -> list[dict[str, Any]]:
        from prep.cache import load_datalist

        return [entry for _, entry in load_datalist(self.datasets[row.data])]


@pytest.fixture(scope="session")
def caches(tmp_path_factory: pytest.TempPathFactory, datasets: dict[str, Path]) -> Caches:
    return Caches(tmp_path_factory.mktemp("conformance-caches"), datasets)
