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


@pytest.fixture(scope="session")
def datasets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """name -> datalist: "3d" five 24^3 volumes, "3d-ragged" four of different shapes, "2d" five 2D slices."""
    from prep.synth import nifti_dataset

    root = tmp_path_factory.mktemp("conformance-data")
    return {
        "3d": nifti_dataset(root / "3d", count=5, size=24, seed=3),
        "3d-ragged": nifti_dataset(root / "ragged", count=4, size=22, seed=5, shape_range=0.2),
        "2d": _nifti_2d(root / "2d"),
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
            pipeline.write_text(f"from chaintable import ROWS\n\ntransform = ROWS[{row.name!r}].chain()\n")
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
