"""PreparedPersistentDataset over a datalist with entries its cache lacks (grown, or changed since `prep cache`):
those items are computed as MONAI's PersistentDataset computes an item it has no file for, and every item equals
PersistentDataset's, against MONAI itself."""

from __future__ import annotations

import inspect
import json
import pickle
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("monai")

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


@pytest.fixture(scope="module")
def grown(nifti_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A cache prepared from the first 4 entries; the datalist those 4, 2 more, and one changed entry."""
    from prep.cache import load_datalist, prepare_cache

    tmp = tmp_path_factory.mktemp("grown")
    (tmp / "pipeline.py").write_text(PIPELINE)
    data = [entry for _, entry in load_datalist(nifti_dataset)]
    (tmp / "first4.json").write_text(json.dumps({"training": data[:4]}))
    prepare_cache(tmp / "first4.json", tmp / "pipeline.py", tmp / "cache", workers=1, processes=False)
    changed = {"image": data[0]["image"], "label": data[1]["label"]}
    return {"tmp": tmp, "cache": tmp / "cache", "data": [data[5], *data[:4], changed, data[4]]}


def _transform(tmp: Path) -> Any:
    from prep.pipeline import load_pipeline

    return load_pipeline(tmp / "pipeline.py").transform


def _same(ref: Any, got: Any, meta: bool) -> None:
    """Equal values, types and dtypes; with `meta`, equal MetaTensor meta and applied operations too."""
    from monai.data import MetaTensor

    if isinstance(ref, list):
        assert isinstance(got, list) and len(got) == len(ref)
        for r, g in zip(ref, got):
            _same(r, g, meta)
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


def _theirs(options: dict[str, Any]) -> dict[str, Any]:
    """PersistentDataset's options as the installed MONAI takes them: 1.4 has no track_meta (it keeps meta)."""
    from monai.data import PersistentDataset

    if "track_meta" in inspect.signature(PersistentDataset).parameters:
        return options
    return {k: v for k, v in options.items() if k != "track_meta"}


@pytest.mark.parametrize("track_meta", [True, None])
def test_missing_entries_equal_persistent_dataset(grown: dict[str, Any], track_meta: bool | None) -> None:
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    data, tmp = grown["data"], grown["tmp"]
    theirs, mine = _transform(tmp), _transform(tmp)
    extra = {} if track_meta is None else {"track_meta": track_meta}
    folder = tmp / f"pt-{track_meta}"
    ref = PersistentDataset(data, theirs, folder, **_theirs(extra))
    ours = PreparedPersistentDataset(data, mine, grown["cache"], backend="posix", **extra)
    assert [ours._lookup(i) is None for i in range(len(data))] == [True, False, False, False, False, True, True]
    before = PersistentDataset(data[1:5], theirs, folder, **_theirs(extra))
    [before[i] for i in range(4)]  # its folder holds the four prepared, as the cache does
    for epoch, seed in enumerate((5, 6)):  # the first fills the folder with the rest, the second reads it all
        theirs.set_random_state(seed)
        want = [ref[i] for i in range(len(data))]
        mine.set_random_state(seed)
        got = [ours[i] for i in range(len(data))]
        # computed anew each time here, where PersistentDataset reads its file back from the second epoch on
        # (track_meta=False: plain tensors, whose meta the tail then makes up): values equal, meta the first time
        _same(want, got, meta=bool(track_meta) or epoch == 0)
    assert not list(grown["cache"].glob("*.pt")) and len(list(folder.glob("*.pt"))) == len(data)


def test_missing_entries_under_dataloader_workers(grown: dict[str, Any]) -> None:
    from monai.data import DataLoader, PersistentDataset

    from loaders import PreparedPersistentDataset

    data, tmp = grown["data"], grown["tmp"]
    theirs, mine = _transform(tmp), _transform(tmp)
    ours = PreparedPersistentDataset(data, mine, grown["cache"], backend="posix", track_meta=True)
    ours = pickle.loads(pickle.dumps(ours))  # as a spawn or forkserver worker gets it
    ref = PersistentDataset(data, theirs, tmp / "pt-workers", **_theirs({"track_meta": True}))
    # items as they come (MONAI's collate of a fresh crop's views fails in a worker, PersistentDataset's too)
    torch.manual_seed(9)
    want = list(DataLoader(ref, batch_size=2, num_workers=2, timeout=60, collate_fn=_as_they_come))
    torch.manual_seed(9)
    got = list(DataLoader(ours, batch_size=2, num_workers=2, timeout=60, collate_fn=_as_they_come))
    assert len(got) == len(want) == 4
    _same(want, got, meta=True)


def _as_they_come(batch: list[Any]) -> list[Any]:
    return batch


def test_a_missing_file_fails_as_in_persistent_dataset(grown: dict[str, Any]) -> None:
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    data = [{"image": "/nope/img.nii.gz", "label": "/nope/lab.nii.gz"}]
    transform = _transform(grown["tmp"])
    with pytest.raises(RuntimeError) as theirs:
        PersistentDataset(data, transform, None)[0]
    with pytest.raises(RuntimeError) as ours:
        PreparedPersistentDataset(data, transform, grown["cache"], backend="posix")[0]
    assert type(ours.value) is type(theirs.value) and str(ours.value.__cause__) == str(theirs.value.__cause__)
    assert "/nope/img.nii.gz" in str(ours.value.__cause__)
