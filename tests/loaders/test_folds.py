"""Label-driven crops folded into the read: PreparedLoader's batches equal MONAI's own chain, run from the
source files, item by item, over volumes of different shapes (3D, 2D, one-hot and multi-class labels)."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loaders.errors import FormatError
from loaders.fast.folds import LabelCropFold
from loaders.fast.loader import PreparedLoader

HEAD = """
from monai.transforms import (AsDiscreted, Compose, EnsureChannelFirstd, LoadImaged, RandCropByLabelClassesd,
                              RandCropByPosNegLabeld, RandFlipd, RandScaleIntensityd, ScaleIntensityd)
K = ["image", "label"]
head = [LoadImaged(keys=K), EnsureChannelFirstd(keys=K), ScaleIntensityd(keys="image")]
"""

CHAINS = {
    "posneg-3d": (
        3,
        "uint8",
        HEAD
        + """
transform = Compose(head + [
    RandCropByPosNegLabeld(keys=K, label_key="label", spatial_size=(8, 6, 8), pos=1, neg=2, num_samples=3),
    RandFlipd(keys=K, prob=0.5, spatial_axis=0), RandScaleIntensityd(keys="image", factors=0.2, prob=1.0)])
""",
    ),
    "posneg-image-threshold": (
        3,
        "float32",
        HEAD
        + """
from monai.transforms import CropForegroundd
transform = Compose(head + [CropForegroundd(keys=K, source_key="image", margin=1),  # + coordinate keys, passed on
    RandCropByPosNegLabeld(keys=K, label_key="label", spatial_size=(6, 6, 6), pos=1, neg=1, num_samples=2,
                           image_key="image", image_threshold=0.4),
    RandFlipd(keys=K, prob=0.5, spatial_axis=1)])
""",
    ),
    "posneg-2d": (
        2,
        "uint8",
        HEAD
        + """
transform = Compose(head + [
    RandCropByPosNegLabeld(keys=K, label_key="label", spatial_size=(10, 12), pos=3, neg=1, num_samples=4)])
""",
    ),
    "posneg-onehot": (
        3,
        "uint8",
        HEAD
        + """
transform = Compose(head + [AsDiscreted(keys="label", to_onehot=3),
    RandCropByPosNegLabeld(keys=K, label_key="label", spatial_size=(8, 8, 6), num_samples=2)])
""",
    ),
    "classes-argmax": (
        3,
        "uint8",
        HEAD
        + """
transform = Compose(head + [
    RandCropByLabelClassesd(keys=K, label_key="label", spatial_size=(6, 8, 8), ratios=[1, 2, 3], num_classes=3,
                            num_samples=3, max_samples_per_class=40),
    RandFlipd(keys=K, prob=0.5, spatial_axis=2)])
""",
    ),
    "posneg-nested-inplace": (
        3,
        "uint8",
        HEAD
        + """
from monai.transforms import Lambdad
transform = Compose(head + [Compose([
    RandCropByPosNegLabeld(keys=K, label_key="label", spatial_size=(6, 8, 6), pos=1, neg=1, num_samples=2),
    Compose([RandFlipd(keys=K, prob=0.5, spatial_axis=0),
             Lambdad(keys="image", func=lambda x: x.mul_(2.0))])])])  # nested, and writes its input in place
""",
    ),
    "classes-onehot-image": (
        3,
        "uint8",
        HEAD
        + """
transform = Compose(head + [AsDiscreted(keys="label", to_onehot=3),
    RandCropByLabelClassesd(keys=K, label_key="label", spatial_size=(8, 6, 6), num_samples=2,
                            image_key="image", image_threshold=0.3)])
""",
    ),
}


def _volumes(root: Path, ndim: int, dtype: str, n: int = 5, trim: int = 0) -> Path:
    """n image/label pairs of different shapes: a noisy image, labels 0/1/2 in two blobs (`trim` voxels off
    the label's first axis at each end: the two keys' shapes differ)."""
    import nibabel as nib

    rng = np.random.default_rng(ndim)
    root.mkdir(parents=True)
    entries = []
    for i in range(n):
        shape = tuple(int(s) for s in rng.integers(14, 22, size=ndim))
        grid = np.indices(shape).astype(np.float32)
        centre = np.array(shape, dtype=np.float32)[(slice(None),) + (None,) * ndim] / 2
        r = np.sqrt(((grid - centre) ** 2).sum(0))
        label = (r < 4).astype(dtype) + (r < 2 + i % 2).astype(dtype)
        image = (rng.random(shape) + label).astype(np.float32)
        if trim:
            label = label[trim:-trim]
        for name, data in (("image", image), ("label", label)):
            nib.save(nib.Nifti1Image(data, np.eye(4)), root / f"{name}{i}.nii.gz")
        entries.append({"image": f"image{i}.nii.gz", "label": f"label{i}.nii.gz"})
    (root / "dataset.json").write_text(json.dumps({"training": entries}))
    return root / "dataset.json"


@pytest.fixture(scope="module", params=sorted(CHAINS))
def chain(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path, Path, Path]:
    """(name, datalist, pipeline, cache with its sampling sets)."""
    from prep.cache import prepare_cache

    name = request.param
    ndim, dtype, source = CHAINS[name]
    root = tmp_path_factory.mktemp(name)
    datalist = _volumes(root / "data", ndim, dtype)
    pipeline = root / "pipeline.py"
    pipeline.write_text(source)
    summary = prepare_cache(datalist, pipeline, root / "cache", workers=1)
    assert "sampling sets: 5 items" in summary.sampling
    return name, datalist, pipeline, root / "cache"


def _transform(pipeline: Path) -> Any:
    from prep.pipeline import load_pipeline

    return load_pipeline(pipeline).transform


def _monai_batches(datalist: Path, pipeline: Path, orders: list[list[int]], seed: int) -> list[dict[str, Any]]:
    """MONAI itself: the head from the source files, then the tail (seeded by the user's transform), item by
    item in the loader's order, each batch collated by list_data_collate."""
    from monai.data import list_data_collate
    from monai.transforms import Compose

    from loaders.cache import chain
    from prep.cache import load_datalist

    transform = _transform(pipeline)
    head, tail = chain.split(transform)
    entries = [e for _, e in load_datalist(datalist)]
    heads = [Compose(head)(dict(e)) for e in entries]
    tail_c = Compose(tail)  # built first: a Compose re-seeds its members
    transform.set_random_state(seed=seed)  # as a MONAI user seeds it, through their own nesting
    out = []
    for order in orders:
        samples: list[Any] = []
        for i in order:
            got = tail_c(copy.deepcopy(heads[i]))  # a fresh head, as PersistentDataset/CacheDataset give it
            samples.extend(got if isinstance(got, list) else [got])
        out.append(list_data_collate(samples))
    return out


def _same(got: dict[str, Any], want: dict[str, Any]) -> None:
    for key in want:  # every key MONAI's batch has (CropForegroundd's coordinates too)
        w = want[key].as_tensor() if hasattr(want[key], "as_tensor") else want[key]
        assert got[key].shape == w.shape, key
        assert got[key].dtype == w.dtype, key
        assert np.array_equal(got[key].numpy(), w.numpy()), key


@pytest.mark.parametrize(
    ("crop_read", "budget", "tail_thread", "feeder"),
    [("auto", 0, True, False), ("auto", "1GiB", False, False), (False, 0, True, False), ("auto", 30000, True, False),
     ("auto", "1GiB", None, True)],
    ids=["crop-reads", "tier", "whole-reads", "part-tier", "feeder"],
)  # fmt: skip
def test_label_crops_equal_monai(
    chain: tuple[str, Path, Path, Path], crop_read: Any, budget: Any, tail_thread: bool | None, feeder: bool
) -> None:
    name, datalist, pipeline, cache = chain
    loader = PreparedLoader(cache, _transform(pipeline), batch_size=2, device="cpu", seed=5, drop_last=False,
                            crop_read=crop_read, gpu_budget=budget, tail_thread=tail_thread, feeder=feeder)  # fmt: skip
    assert loader.fold is not None and type(loader.fold).__name__ == "LabelCropFold"
    loader.set_random_state(9)
    got = [b for _ in range(2) for b in loader]
    loader.close()
    orders = [[int(i) for i in loader.epoch_items(e)[k : k + 2]] for e in range(2) for k in range(0, 5, 2)]
    want = _monai_batches(datalist, pipeline, orders, 9)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        _same(g, w)


def test_another_seed_differs(chain: tuple[str, Path, Path, Path]) -> None:
    """Negative control: the comparison above can fail."""
    _, datalist, pipeline, cache = chain
    loader = PreparedLoader(cache, _transform(pipeline), batch_size=5, device="cpu", shuffle=False)
    loader.set_random_state(1)
    got = next(iter(loader))
    want = _monai_batches(datalist, pipeline, [[0, 1, 2, 3, 4]], 2)[0]
    with pytest.raises(AssertionError):
        _same(got, want)


def test_fast_path_never_scans_a_label(chain: tuple[str, Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """With the sets prepared, no whole-label scan runs at training time (MONAI's index functions raise)."""
    import monai.transforms.croppad.array as croppad
    import monai.transforms.utils as utils

    def scan(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a whole label was scanned")

    for module in (utils, croppad):
        monkeypatch.setattr(module, "map_binary_to_indices", scan)
        monkeypatch.setattr(module, "map_classes_to_indices", scan)
    _, _, pipeline, cache = chain
    loader = PreparedLoader(cache, _transform(pipeline), batch_size=2, device="cpu", gpu_budget="1GiB")
    assert sum(len(b["_items"]) for _ in range(2) for b in loader) > 0


def test_cache_without_sets_is_slow_said_once_then_added(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A cache made before the sets: the crop runs through MONAI (said once, with the command); `prep sampling`
    adds the sets without running the head; a damaged set is refused in one line."""
    import shutil

    from typer.testing import CliRunner

    from loaders.cache import sampling
    from prep.cache import prepare_cache
    from prep.cli import app

    datalist = _volumes(tmp_path / "data", 3, "uint8", n=3)
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(CHAINS["posneg-3d"][2])
    cache = tmp_path / "cache"
    prepare_cache(datalist, pipeline, cache, workers=1)
    shutil.rmtree(cache / sampling.DIR)
    with caplog.at_level(logging.WARNING, logger="loaders.fast.folds"):
        slow = PreparedLoader(cache, _transform(pipeline), batch_size=3, device="cpu", shuffle=False)
        PreparedLoader(cache, _transform(pipeline), batch_size=3, device="cpu", shuffle=False)
    assert slow.fold is None
    said = [r.getMessage() for r in caplog.records if "prep sampling" in r.getMessage()]
    assert len(said) == 1 and str(cache) in said[0]
    slow.set_random_state(4)
    want = next(iter(slow))

    result = CliRunner().invoke(app, ["sampling", str(cache), "--pipeline", str(pipeline)])
    assert result.exit_code == 0, result.output
    fast = PreparedLoader(cache, _transform(pipeline), batch_size=3, device="cpu", shuffle=False)
    assert fast.fold is not None
    fast.set_random_state(4)
    _same(next(iter(fast)), want)

    bits = next((cache / sampling.DIR).iterdir()) / sampling.BITS
    data = bytearray(bits.read_bytes())
    data[-8] ^= 0xFF  # the last item's last running count
    bits.write_bytes(bytes(data))
    broken = PreparedLoader(cache, _transform(pipeline), batch_size=3, device="cpu", shuffle=False)
    with pytest.raises(FormatError, match="checksum|counts"):
        next(iter(broken))


@pytest.mark.parametrize("name", ["posneg-image-threshold", "classes-argmax", "posneg-nested-inplace"])
def test_drop_in_draws_from_the_sets_as_persistent_dataset_draws(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PreparedPersistentDataset with a label-driven crop: the same samples as MONAI's PersistentDataset under
    MONAI's DataLoader, and no scan of a label (MONAI's index functions raise while the drop-in runs)."""
    import monai.transforms.croppad.array as croppad
    import monai.transforms.utils as utils
    from monai.data import DataLoader, PersistentDataset
    from monai.utils import set_determinism

    from loaders import PreparedPersistentDataset
    from prep.cache import load_datalist, prepare_cache

    ndim, dtype, source = CHAINS[name]
    datalist = _volumes(tmp_path / "data", ndim, dtype, n=4)
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(source)
    prepare_cache(datalist, pipeline, tmp_path / "cache", workers=1)
    data = [e for _, e in load_datalist(datalist)]

    def batches(ds: Any) -> list[dict[str, Any]]:
        set_determinism(seed=3)  # MONAI's DataLoader then seeds the dataset's transform
        return [b for _ in range(2) for b in DataLoader(ds, batch_size=2, shuffle=False, num_workers=0)]

    want = batches(PersistentDataset(data, _transform(pipeline), cache_dir=tmp_path / "pt"))

    def scan(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a whole label was scanned")

    for module in (utils, croppad):
        monkeypatch.setattr(module, "map_binary_to_indices", scan)
        monkeypatch.setattr(module, "map_classes_to_indices", scan)
    ours = PreparedPersistentDataset(data, _transform(pipeline), cache_dir=tmp_path / "cache")
    assert isinstance(ours._crop, LabelCropFold)
    got = batches(ours)
    set_determinism(seed=None)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert set(g) == set(w)
        for key in ("image", "label"):
            assert np.array_equal(np.asarray(g[key]), np.asarray(w[key])), key


SLICES = """
from monai.transforms import (Compose, EnsureChannelFirstd, LoadImaged, RandFlipd, RandRotated,
                              RandSpatialCropSamplesd, SqueezeDimd)
K = ["image", "label"]
transform = Compose([LoadImaged(keys=K), EnsureChannelFirstd(keys=K),
    RandSpatialCropSamplesd(keys=K, roi_size=(8, 8, 1), num_samples=3, random_size=False),
    SqueezeDimd(keys=K, dim=-1), RandFlipd(keys=K, prob=0.5, spatial_axis=0),
    RandRotated(keys=K, range_x=0.4, prob=0.5, mode=("bilinear", "nearest"))])
"""


def test_slices_of_volumes_read_only_their_crops_and_run_batched(tmp_path: Path) -> None:
    """RandSpatialCropSamplesd is folded into the read (only the slices' bytes move), SqueezeDimd and
    RandRotated run over the batch, and the batches equal MONAI's per-item chain; where an item's keys
    differ in spatial shape (MONAI then draws each key's windows over its own) the crop is not folded."""
    from loaders.fast.folds import SpatialSamplesFold
    from prep.cache import prepare_cache

    datalist = _volumes(tmp_path / "data", 3, "uint8")
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(SLICES)
    prepare_cache(datalist, pipeline, tmp_path / "cache", workers=1)
    loader = PreparedLoader(tmp_path / "cache", _transform(pipeline), batch_size=2, device="cpu", shuffle=False,
                            drop_last=True, gpu_budget=0)  # fmt: skip
    loader.set_random_state(3)
    assert isinstance(loader.fold, SpatialSamplesFold)
    assert loader.assembly.tail.fallbacks == []  # nothing per item through MONAI
    got = list(loader)
    want = _monai_batches(datalist, pipeline, [[0, 1], [2, 3]], 3)
    for g, w in zip(got, want):
        _same(g, w)
    plan = loader.assembly.fetch(loader.assembly.plan([0, 1]))  # (draws: after the comparison)
    assert set(plan.reads) == {"regions"} and len(plan.rows) == 6
    loader.close()
    cache = loader.cache
    assert cache.same_spatial(["image", "label"]) and cache.same_spatial(["image"])
    from loaders.cache.writing import write_items
    from loaders.fast.folds import split_fold

    items = [{"image": np.zeros((1, 8, 8, 4), np.float32), "label": np.zeros((1, 8, 8, 5), np.uint8)}]
    other = write_items(tmp_path / "other", items)
    assert not other.same_spatial(["image", "label"]) and other.same_spatial(["label"])
    crop = _transform(pipeline).transforms[2]
    assert split_fold([crop], ["image", "label"], other)[0] is None  # each key's windows are its own: not folded
    assert isinstance(split_fold([crop], ["image", "label"], cache)[0], SpatialSamplesFold)


FIRST_KEY = (
    HEAD
    + """
from monai.transforms import RandSpatialCropd
transform = Compose(head + [RandSpatialCropd(keys=["label", "image"], roi_size=(6, 5, 4)),
                            RandFlipd(keys=K, prob=0.5, spatial_axis=0)])
"""
)


@pytest.mark.parametrize("crop_read", ["auto", False])
def test_spatial_crop_draws_over_the_transforms_first_key(tmp_path: Path, crop_read: Any) -> None:
    """RandSpatialCropd(keys=["label", "image"]) over keys of different shapes: MONAI draws the window over
    its first key's (the label's) shape and cuts every key with it; so does the loader, folded or not."""
    from prep.cache import prepare_cache

    datalist = _volumes(tmp_path / "data", 3, "uint8", trim=2)
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(FIRST_KEY)
    prepare_cache(datalist, pipeline, tmp_path / "cache", workers=1)
    loader = PreparedLoader(tmp_path / "cache", _transform(pipeline), batch_size=2, device="cpu", shuffle=False,
                            drop_last=True, gpu_budget=0, crop_read=crop_read)  # fmt: skip
    loader.set_random_state(4)
    got = [b for _ in range(2) for b in loader]
    loader.close()
    want = _monai_batches(datalist, pipeline, [[0, 1], [2, 3]] * 2, 4)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        _same(g, w)


def test_drop_in_with_label_crops_pickles_and_runs_under_spawned_workers(tmp_path: Path) -> None:
    """The drop-in (its lock, the sets' lock and mapping) pickles; under DataLoader workers started by spawn it
    gives PersistentDataset's batches under the same workers and seed."""
    import pickle

    import torch
    from monai.data import DataLoader, PersistentDataset

    from loaders import PreparedPersistentDataset
    from prep.cache import load_datalist, prepare_cache

    ndim, dtype, source = CHAINS["posneg-3d"]
    datalist = _volumes(tmp_path / "data", ndim, dtype, n=4)
    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(source)
    prepare_cache(datalist, pipeline, tmp_path / "cache", workers=1)
    data = [e for _, e in load_datalist(datalist)]
    ours = PreparedPersistentDataset(data, _transform(pipeline), cache_dir=tmp_path / "cache")
    assert isinstance(ours._crop, LabelCropFold)
    back = pickle.loads(pickle.dumps(ours))
    back.transform.set_random_state(1)
    ours.transform.set_random_state(1)
    for i in range(len(data)):
        a, b = ours[i], back[i]
        for j in range(len(a)):
            assert np.array_equal(np.asarray(a[j]["image"]), np.asarray(b[j]["image"]))

    def batches(ds: Any) -> list[dict[str, Any]]:
        torch.manual_seed(5)  # the workers' seeds (MONAI's worker_init_fn seeds each worker's chain from them)
        loader = DataLoader(ds, batch_size=2, num_workers=2, multiprocessing_context="spawn", timeout=120)
        return list(loader)

    want = batches(PersistentDataset(data, _transform(pipeline), cache_dir=tmp_path / "pt"))
    got = batches(PreparedPersistentDataset(data, _transform(pipeline), cache_dir=tmp_path / "cache"))
    assert len(got) == len(want) == 2
    for g, w in zip(got, want):
        for key in ("image", "label"):
            assert np.array_equal(np.asarray(g[key]), np.asarray(w[key])), key
