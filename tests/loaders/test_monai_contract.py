"""PreparedPersistentDataset keeps MONAI's PersistentDataset contract (issue 46): it is one (isinstance, its
attributes, its positional arguments), and where no prepared cache serves (cache_dir=None, a folder without one,
in-memory data, transform=None) it is PersistentDataset itself: what MONAI's own tests of PersistentDataset check
(tests/data/test_persistentdataset*.py, test_cachedataset.py::TestCacheThread), checked here against MONAI."""

from __future__ import annotations

import inspect
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("monai")

PIPELINE = """
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandCropByPosNegLabeld, RandFlipd, Spacingd
KEYS = ["image", "label"]
transform = Compose([
    LoadImaged(keys=KEYS),
    EnsureChannelFirstd(keys=KEYS),
    Spacingd(keys=KEYS, pixdim=(1.0, 1.0, 1.5), mode=("bilinear", "nearest")),
    RandCropByPosNegLabeld(keys=KEYS, label_key="label", spatial_size=(12, 12, 12), pos=1, neg=1, num_samples=2),
    RandFlipd(keys=KEYS, prob=0.5, spatial_axis=0),
])
"""


class _InPlace:
    """Changes its input in place, as MONAI's test transform does: the hashed entry must stay as it was."""

    def __call__(self, data: Any) -> Any:
        if data:
            data[0] = data[0] + np.pi
        else:
            data.append(1)
        return data


class _Stateful:
    """A stateful transform over ints (MONAI's TestCacheThread): cached once, so every item adds 2."""

    def __init__(self) -> None:
        self.property = 1

    def __call__(self, data: Any) -> Any:
        self.property += 1
        return data * 100 + self.property


def _as_transform(cls: type) -> Any:
    """`cls` as a MONAI Transform; ThreadUnsafe: PersistentDataset runs the head on a copy of it."""
    from monai.transforms import ThreadUnsafe, Transform

    return type(cls.__name__, (cls, Transform, ThreadUnsafe), {})()


def _both(*args: Any, **kwargs: Any) -> tuple[Any, Any]:
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    return PersistentDataset(*args, **kwargs), PreparedPersistentDataset(*args, **kwargs)


def test_is_a_persistent_dataset_with_its_attributes(tmp_path: Path) -> None:
    from monai.data import PersistentDataset, json_hashing
    from monai.transforms import Identity

    ref, ours = _both([[1], [2]], Identity(), tmp_path / "c", json_hashing, "pickle", 2, json_hashing, False)
    assert isinstance(ours, PersistentDataset)
    for name in ("cache_dir", "hash_func", "pickle_module", "pickle_protocol", "transform_hash", "reset_ops_id"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.cache_dir == tmp_path / "c" and ours.pickle_protocol == 2 and ours.reset_ops_id is False
    assert ours.transform_hash and callable(ours.set_transform_hash) and callable(ours.set_data)
    theirs = list(inspect.signature(PersistentDataset.__init__).parameters)[1:]
    with pytest.raises(TypeError):  # one positional more than PersistentDataset takes
        type(ours)([1], Identity(), None, *[None] * (len(theirs) - 2))


@pytest.mark.parametrize("hash_name", ["pickle_hashing", "json_hashing"])
def test_in_memory_items_as_persistent_dataset(tmp_path: Path, hash_name: str) -> None:
    """MONAI's test_cache: nested lists, an in-place transform, a second dataset over the filled folder."""
    import monai.data

    hashing = getattr(monai.data, hash_name)
    items = [[list(range(i))] for i in range(5)]
    before = [[[]], [[0]], [[0, 1]], [[0, 1, 2]], [[0, 1, 2, 3]]]
    ref = list(monai.data.PersistentDataset(items, _as_transform(_InPlace), tmp_path / "ref", hash_func=hashing))
    assert items == before
    from loaders import PreparedPersistentDataset

    for _ in range(2):  # fills the folder, then reads it
        got = list(PreparedPersistentDataset(items, _as_transform(_InPlace), tmp_path / "ours", hash_func=hashing))
        assert got == ref and items == before
    assert len(list((tmp_path / "ours").glob("*.pt"))) == len(items)


def test_one_folder_two_transforms(tmp_path: Path) -> None:
    """MONAI's test_different_transforms: numpy arrays, hash_transform keys the files by transform."""
    from monai.data import json_hashing
    from monai.transforms import Flip, Identity

    from loaders import PreparedPersistentDataset

    im = np.arange(0, 10 * 9 * 8).reshape((1, 10, 9, 8))
    got = [PreparedPersistentDataset([im], t, tmp_path, hash_transform=json_hashing)[0] for t in (Identity(), Flip(1))]
    assert float(((got[0] - got[1]) ** 2).sum() ** 0.5) > 1
    np.testing.assert_array_equal(np.asarray(got[1]), np.flip(im, 2))  # spatial axis 1 of a channel-first array


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_transform_under_loader_workers(tmp_path: Path, workers: int) -> None:
    """MONAI's TestCacheThread: ints as items, two epochs through DataLoader, each item's head cached once."""
    from monai.data import DataLoader

    from loaders import PreparedPersistentDataset

    expected = [102, 202, 302, 402, 502, 602, 702, 802, 902, 1002]
    data = list(range(1, 11))
    assert list(PreparedPersistentDataset(data, _as_transform(_Stateful), tmp_path)) == expected
    loader = DataLoader(PreparedPersistentDataset(data, _as_transform(_Stateful), tmp_path), num_workers=workers)
    for _ in range(2):
        assert [y.item() for y in loader] == expected


@pytest.fixture(scope="module")
def spheres(nifti_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from prep.cache import load_datalist, prepare_cache
    from prep.pipeline import load_pipeline

    tmp = tmp_path_factory.mktemp("contract")
    (tmp / "pipeline.py").write_text(PIPELINE)
    prepare_cache(nifti_dataset, tmp / "pipeline.py", tmp / "cache", workers=1, processes=False)
    data = [entry for _, entry in load_datalist(nifti_dataset)]
    return {"data": data, "cache": tmp / "cache", "transform": load_pipeline(tmp / "pipeline.py").transform}


def _equal(ref: Any, got: Any) -> None:
    if isinstance(ref, dict):
        assert isinstance(got, dict) and sorted(ref) == sorted(got)
        for k in ref:
            _equal(ref[k], got[k])
    elif isinstance(ref, (list, tuple)):
        assert len(ref) == len(got)
        for r, g in zip(ref, got):
            _equal(r, g)
    elif isinstance(ref, torch.Tensor):
        assert type(got) is type(ref) and torch.equal(torch.as_tensor(got), torch.as_tensor(ref))
    else:
        assert got == ref


@pytest.mark.parametrize("where", ["none", "empty"])
def test_without_a_prepared_cache_as_persistent_dataset(spheres: dict[str, Any], tmp_path: Path, where: str) -> None:
    """cache_dir=None (no cache) and a folder `prep cache` never wrote: PersistentDataset's own values, seeded
    alike; transform=None gives the entries back."""
    from monai.data.utils import set_rnd
    from monai.utils import set_determinism

    cache_dir = None if where == "none" else tmp_path / "pt"
    sides = []
    for cls_index in range(2):
        set_determinism(seed=3)
        ds = _both(spheres["data"][:2], spheres["transform"], cache_dir)[cls_index]
        set_rnd(ds, seed=11)  # as MONAI's DataLoader seeds a dataset
        sides.append([ds[0], ds[1], ds[0]])
    set_determinism(None)
    _equal(*sides)
    ref, ours = _both(spheres["data"], None, None if cache_dir is None else tmp_path / "none")  # not the heads
    _equal(list(ref[0:3]), list(ours[0:3]))
    assert ours[0]["image"] == spheres["data"][0]["image"]


def test_prepared_cache_kept_by_set_data(spheres: dict[str, Any]) -> None:
    """In-memory data over a folder holding a prepared cache: PersistentDataset's files beside it, and set_data
    deletes those only (PersistentDataset's empties the folder)."""
    from monai.transforms import Identity

    from loaders import PreparedPersistentDataset

    ds = PreparedPersistentDataset(spheres["data"], spheres["transform"], spheres["cache"])
    assert ds._prepared
    ds.set_data([np.zeros(3), np.ones(3)])
    assert not ds._prepared
    ints = PreparedPersistentDataset([1, 2], Identity(), spheres["cache"])
    assert list(ints) == [1, 2] and len(list(spheres["cache"].glob("*.pt"))) == 2
    ints.set_data([3])
    assert not list(spheres["cache"].glob("*.pt")) and list(ints) == [3]
    assert (spheres["cache"] / "manifest.json").is_file()
    again = PreparedPersistentDataset(spheres["data"], spheres["transform"], spheres["cache"])
    assert again._prepared and len(again) == len(spheres["data"])
    pickle.loads(pickle.dumps(again))


def test_hash_transform_over_a_cache_of_another_head_is_persistent_datasets(
    spheres: dict[str, Any], tmp_path: Path
) -> None:
    """With hash_transform MONAI keys its files by the transform, so one folder serves several transforms: over a
    prepared cache of another head the drop-in gives PersistentDataset's values and files, and leaves the cache
    alone (without hash_transform, another head is a StaleError)."""
    import shutil

    from monai.data import PersistentDataset, json_hashing
    from monai.data.utils import set_rnd
    from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandFlipd

    from loaders import PreparedPersistentDataset
    from loaders.errors import StaleError

    folder = tmp_path / "cache"
    shutil.copytree(spheres["cache"], folder)
    before = set(folder.glob("*.pt"))  # another test's own files in the shared cache folder
    keys = ["image", "label"]
    other = Compose([LoadImaged(keys), EnsureChannelFirstd(keys), RandFlipd(keys, prob=0.5, spatial_axis=0)])
    data = spheres["data"][:2]
    with pytest.raises(StaleError):
        PreparedPersistentDataset(data, other, folder)
    sides = []
    for ds in (
        PersistentDataset(data, other, tmp_path / "pt", hash_transform=json_hashing),
        PreparedPersistentDataset(data, other, folder, hash_transform=json_hashing),
    ):
        set_rnd(ds, seed=11)  # as MONAI's DataLoader seeds a dataset
        sides.append([ds[0], ds[1], ds[0]])
    _equal(*sides)
    assert len(set(folder.glob("*.pt")) - before) == 2 and (folder / "manifest.json").is_file()
    assert PreparedPersistentDataset(spheres["data"], spheres["transform"], folder)._prepared
