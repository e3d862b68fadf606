"""Helpers for the drop-in's tests over a grown datalist (tests/loaders/test_monai_grown.py, test_monai_fill.py):
the pipeline, a cache prepared from part of a datalist, and the comparison against MONAI's PersistentDataset."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path
from typing import Any

import torch

PIPELINE = """
from monai.transforms import (Compose, EnsureChannelFirstd, LoadImaged, RandCropByPosNegLabeld, RandFlipd,
                              ScaleIntensityRanged, Spacingd)
KEYS = ["image", "label"]
transform = Compose([
    LoadImaged(keys=KEYS),
    EnsureChannelFirstd(keys=KEYS),
    Spacingd(keys=KEYS, pixdim=(1.0, 1.0, 1.5), mode=("bilinear", "nearest")),
    ScaleIntensityRanged(keys="image", a_min=0.0, a_max=1000.0, b_min=0.0, b_max=1.0, clip=True),
    RandCropByPosNegLabeld(keys=KEYS, label_key="label", spatial_size=(12, 12, 12), pos=1, neg=1, num_samples=2),
    RandFlipd(keys=KEYS, prob=0.5, spatial_axis=0),
])
"""


def make_grown(nifti_dataset: Path, tmp: Path) -> dict[str, Any]:
    """A cache prepared from the first 4 entries; the datalist those 4, 2 more, and one changed entry."""
    from prep.cache import load_datalist, prepare_cache

    (tmp / "pipeline.py").write_text(PIPELINE)
    data = [entry for _, entry in load_datalist(nifti_dataset)]
    (tmp / "first4.json").write_text(json.dumps({"training": data[:4]}))
    prepare_cache(tmp / "first4.json", tmp / "pipeline.py", tmp / "cache", workers=1, processes=False)
    changed = {"image": data[0]["image"], "label": data[1]["label"]}
    return {"tmp": tmp, "cache": tmp / "cache", "data": [data[5], *data[:4], changed, data[4]]}


def fresh_copy(grown: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """`grown` with a copy of its cache of its own (the drop-in writes computed items into its cache)."""
    shutil.copytree(grown["cache"], tmp / "cache")
    return {**grown, "cache": tmp / "cache"}


def transform_of(tmp: Path) -> Any:
    from prep.pipeline import load_pipeline

    return load_pipeline(tmp / "pipeline.py").transform


def same(ref: Any, got: Any, meta: bool) -> None:
    """Equal values, types and dtypes; with `meta`, equal MetaTensor meta and applied operations too."""
    from monai.data import MetaTensor

    if isinstance(ref, list):
        assert isinstance(got, list) and len(got) == len(ref)
        for r, g in zip(ref, got):
            same(r, g, meta)
        return
    assert set(ref) == set(got)
    for key in ("image", "label"):
        r, g = ref[key], got[key]
        assert type(g) is type(r) and g.dtype == r.dtype
        assert torch.equal(torch.as_tensor(r), torch.as_tensor(g))
        if meta and isinstance(r, MetaTensor):
            assert torch.equal(r.affine, g.affine) and r.meta.get("filename_or_obj") == g.meta.get("filename_or_obj")
            assert set(r.meta) == set(g.meta)
            assert [op["class"] for op in r.applied_operations] == [op["class"] for op in g.applied_operations]


def theirs_options(options: dict[str, Any]) -> dict[str, Any]:
    """PersistentDataset's options as the installed MONAI takes them: 1.4 has no track_meta (it keeps meta)."""
    from monai.data import PersistentDataset

    if "track_meta" in inspect.signature(PersistentDataset).parameters:
        return options
    return {k: v for k, v in options.items() if k != "track_meta"}


def as_they_come(batch: list[Any]) -> list[Any]:
    return batch


def records(cache: Path) -> list[dict[str, Any]]:
    """Every line of every drop-in journal of `cache`."""
    return [
        json.loads(line) for f in sorted((cache / "journal").glob("fill-*.fill")) for line in f.read_text().splitlines()
    ]
