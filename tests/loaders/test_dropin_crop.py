"""The drop-in reads only a leading RandSpatialCropd's window, and still gives PersistentDataset's items."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("monai")

HEAD = """
from monai.transforms import (Compose, EnsureChannelFirstd, LoadImaged, NormalizeIntensityd, RandFlipd,
                              RandSpatialCropd, ScaleIntensityd)
KEYS = ["image", "label"]
transform = Compose([
    LoadImaged(keys=KEYS),
    EnsureChannelFirstd(keys=KEYS),
    ScaleIntensityd(keys="image"),
    CROP,
    NormalizeIntensityd(keys="image"),  # a mean and a std over the crop: the view's layout matters to the bit
    RandFlipd(keys=KEYS, prob=0.5, spatial_axis=0),
])
"""

CROPS = {
    "random": "RandSpatialCropd(keys=KEYS, roi_size=(12, 10, 14), random_size=False)",
    "random-size": "RandSpatialCropd(keys=KEYS, roi_size=(8, 8, 8), max_roi_size=(20, 20, 20), random_size=True)",
    "centre": "RandSpatialCropd(keys=KEYS, roi_size=(12, 12, 12), random_center=False, random_size=False)",
    "past-the-edge": "RandSpatialCropd(keys=KEYS, roi_size=(48, 12, 40), random_size=False)",
}


@pytest.fixture(scope="module", params=sorted(CROPS))
def prepared(request: pytest.FixtureRequest, nifti_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from prep.cache import load_datalist, prepare_cache

    tmp = tmp_path_factory.mktemp(f"crop-{request.param}")
    pipeline = tmp / "pipeline.py"
    pipeline.write_text(HEAD.replace("CROP", CROPS[request.param]))
    prepare_cache(nifti_dataset, pipeline, tmp / "cache", workers=1, processes=False)
    return tmp, pipeline, [entry for _, entry in load_datalist(nifti_dataset)]


def _transform(pipeline: Path) -> Any:
    from prep.pipeline import load_pipeline

    return load_pipeline(pipeline).transform


def _equal(want: Any, got: Any, track_meta: bool) -> None:
    from monai.data import MetaTensor

    assert set(want) == set(got)
    for key in ("image", "label"):
        w, g = want[key], got[key]
        assert type(w) is type(g) and w.dtype == g.dtype and w.shape == g.shape, key
        assert torch.equal(torch.as_tensor(w), torch.as_tensor(g)), key  # to the bit
        if track_meta:
            assert isinstance(g, MetaTensor)
            assert torch.equal(w.affine, g.affine)
            assert [op["class"] for op in w.applied_operations] == [op["class"] for op in g.applied_operations]
            assert [op.get("extra_info") for op in w.applied_operations] == [
                op.get("extra_info") for op in g.applied_operations
            ]


@pytest.mark.parametrize("track_meta", [True, False])
def test_window_reads_equal_persistent_dataset(
    prepared: Any, track_meta: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import inspect

    from monai.data import PersistentDataset

    from loaders.dataset import DatasetCore
    from loaders.monai import PreparedPersistentDataset

    tmp, pipeline, data = prepared
    transform = _transform(pipeline)
    options: dict[str, Any] = {}
    if "track_meta" in inspect.signature(PersistentDataset).parameters:
        options = {"track_meta": track_meta}
    elif not track_meta:
        pytest.skip("this MONAI's PersistentDataset keeps meta (no track_meta)")
    ref = PersistentDataset(data, transform, tmp / f"pt-{track_meta}", **options)
    [ref[i] for i in range(len(data))]  # epoch 1 fills MONAI's cache (plain tensors from epoch 2 without meta)
    ours = PreparedPersistentDataset(data, transform, tmp / "cache", backend="posix", track_meta=track_meta)
    assert ours._spatial is not None  # the window path is taken here
    transform.set_random_state(5)
    want = [ref[i] for i in range(len(data))]

    def whole(*_: Any) -> Any:
        raise AssertionError("the whole item was read")

    monkeypatch.setattr(DatasetCore, "__getitem__", whole)
    transform.set_random_state(5)
    got = [ours[i] for i in range(len(data))]
    for w, g in zip(want, got):
        _equal(w, g, track_meta)


def test_other_leading_transforms_and_subclasses_read_whole_items(prepared: Any) -> None:
    from monai.transforms import Compose, RandSpatialCropd

    from loaders.dropin_crop import SpatialCropRead
    from loaders.monai import PreparedPersistentDataset

    tmp, pipeline, data = prepared
    ours = PreparedPersistentDataset(data, _transform(pipeline), tmp / "cache", backend="posix")

    class MyCrop(RandSpatialCropd):
        pass

    assert SpatialCropRead.of(Compose([MyCrop(keys=["image", "label"], roi_size=(8, 8, 8))]), ours.dataset) is None
    crop = RandSpatialCropd(keys=["image"], roi_size=(8, 8, 8))  # "label" would stay whole: not this path
    assert SpatialCropRead.of(Compose([crop]), ours.dataset) is None
    lazy = Compose([RandSpatialCropd(keys=["image", "label"], roi_size=(8, 8, 8))], lazy=True)
    assert SpatialCropRead.of(lazy, ours.dataset) is None
