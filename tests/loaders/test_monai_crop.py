"""loaders.faces.monai_crop: the drop-in's leading crop asks for its own pages first, and draws as MONAI draws."""

from __future__ import annotations

import json
import math
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fsutil import evict_tree

from loaders.backends.base import PageCacheProbe
from loaders.state import peeking

PIPELINE = """
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandSpatialCropd, ScaleIntensityd
K = ["image", "label"]
transform = Compose([LoadImaged(keys=K), EnsureChannelFirstd(keys=K), ScaleIntensityd(keys="image"),
                     RandSpatialCropd(keys=K, roi_size=(CROP, CROP, CROP), random_size=False)])
"""
EDGE, CROP = 96, 32


def _samples(t: Any, data: dict[str, Any]) -> list[np.ndarray]:
    out = t(data)
    return [np.asarray(o["image"]) for o in (out if isinstance(out, list) else [out])]


@pytest.mark.parametrize("kind", ["samples", "posneg", "spatial"])
def test_a_peeked_draw_is_drawn_again_as_monai_draws_it(kind: str) -> None:
    """MONAI's own transforms, twice seeded alike: one draws inside `peeking` first (RandSpatialCropSamplesd
    gives its cropper new generators as it draws), then both draw the same windows."""
    from monai.transforms import RandCropByPosNegLabeld, RandSpatialCropd, RandSpatialCropSamplesd

    keys = ["image", "label"]
    make = {
        "samples": lambda: RandSpatialCropSamplesd(keys, roi_size=(4, 5, 6), num_samples=3, random_size=False),
        "posneg": lambda: RandCropByPosNegLabeld(keys, "label", spatial_size=(4, 5, 6), num_samples=3),
        "spatial": lambda: RandSpatialCropd(keys, roi_size=(4, 5, 6), random_size=True),
    }[kind]
    rng = np.random.default_rng(0)
    data = {"image": rng.random((1, 12, 13, 14), dtype=np.float32),
            "label": (rng.random((1, 12, 13, 14)) > 0.7).astype(np.float32)}  # fmt: skip
    peeked, plain = make().set_random_state(7), make().set_random_state(7)
    with peeking(peeked):
        drawn = _samples(peeked, dict(data))
    for _ in range(2):  # and the draws after it too
        want = _samples(plain, dict(data))
        got = _samples(peeked, dict(data))
        assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))
    assert all(np.array_equal(d, w) for d, w in zip(drawn, _samples(make().set_random_state(7), dict(data))))


def _prepared(root: Path) -> tuple[list[dict[str, str]], Path, Path]:
    import nibabel as nib

    from prep.cache import load_datalist, prepare_cache

    rng = np.random.default_rng(1)
    (root / "data").mkdir(parents=True)
    entries = []
    for i in range(2):
        image = rng.random((EDGE,) * 3, dtype=np.float32)
        label = (image > 0.9).astype(np.uint8)
        for name, array in (("image", image), ("label", label)):
            nib.save(nib.Nifti1Image(array, np.eye(4)), root / "data" / f"{name}{i}.nii")
        entries.append({"image": f"image{i}.nii", "label": f"label{i}.nii"})
    datalist = root / "data" / "dataset.json"
    datalist.write_text(json.dumps({"training": entries}))
    pipeline = root / "pipeline.py"
    pipeline.write_text(PIPELINE.replace("CROP", str(CROP)))
    prepare_cache(datalist, pipeline, root / "cache", workers=1)
    return [e for _, e in load_datalist(datalist)], pipeline, root / "cache"


def _resident(probe: PageCacheProbe, paths: list[Path]) -> int:
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            st = probe.counts(fd, 0, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        assert st is not None
        total += st.cache * mmap.PAGESIZE
    return total


def _dropin(root: Path, counted: bool = True) -> tuple[Any, PageCacheProbe, list[Path]]:
    """(the drop-in over a prepared cache of two volumes, read mapped; the page probe; its shards). `counted`:
    the test counts cached pages (skipped where cachestat(2) is missing)."""
    from loaders import PreparedPersistentDataset
    from prep.pipeline import load_pipeline

    probe = PageCacheProbe()
    if counted and not probe.available:
        pytest.skip("cachestat(2) is not available here (Linux 6.5+): the test counts the shards' cached pages")
    data, pipeline, cache = _prepared(root)
    ds = PreparedPersistentDataset(data, load_pipeline(pipeline).transform, cache_dir=cache, backend="posix")
    return ds, probe, sorted((cache / "shards").iterdir())


def _evicted(probe: PageCacheProbe, shards: list[Path]) -> None:
    """The shards out of the page cache (skipped where fadvise leaves pages: nothing to count)."""
    evict_tree(shards[0].parent)
    if _resident(probe, shards):
        pytest.skip(f"posix_fadvise(DONTNEED) left pages of {shards[0].parent} cached here: nothing to count")


def test_a_cold_item_reads_only_its_crops_pages(tmp_path: Path) -> None:
    """The kernel's readahead widens each fault of a crop over a mapping to most of the volume; asked for first,
    only the crop's byte runs come in (at most one page more at each end of a run)."""
    ds, probe, shards = _dropin(tmp_path)
    ds.set_random_state(3)
    _evicted(probe, shards)
    item = ds[0]
    got = _resident(probe, shards)
    assert tuple(item["image"].shape) == (1, CROP, CROP, CROP)
    # per x-plane of the crop, one run per key: its y-span of whole z-rows, its pages and one more at most
    sizes = [item[k].element_size() for k in ("image", "label")]
    runs = [((CROP - 1) * EDGE + CROP) * size for size in sizes]
    bound = sum(CROP * (math.ceil(n / mmap.PAGESIZE) + 1) * mmap.PAGESIZE for n in runs)
    crop = CROP**3 * sum(sizes)
    assert crop <= got <= bound * 5 // 4, (got, bound, crop)  # without the ask: the whole shard (7 MB)


def test_a_cold_batch_asks_for_every_items_crop_at_once_and_equals_item_by_item(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch's DataLoader fetches a batch through `__getitems__`: both items' crop pages are asked for before
    the first is cropped (their windows drawn ahead one after the other), and the items are those `ds[i]` gives."""
    import loaders.faces.monai_crop as monai_crop

    ds, probe, shards = _dropin(tmp_path)
    ds.set_random_state(3)
    want = [ds[1], ds[0], ds[1]]
    _evicted(probe, shards)
    at_first_crop: list[int] = []
    real = monai_crop.cropping

    def cropping(*args: Any, **kwargs: Any) -> Any:
        at_first_crop.append(_resident(probe, shards))
        return real(*args, **kwargs)

    ds.set_random_state(3)
    monkeypatch.setattr("loaders.faces.monai.cropping", cropping)
    got = ds.__getitems__([1, 0, 1])
    for g, w in zip(got, want, strict=True):
        for key in ("image", "label"):
            assert np.array_equal(np.asarray(g[key]), np.asarray(w[key])), key
    size = got[0]["image"].element_size() + got[0]["label"].element_size()
    # before the first crop ran, the three crops' pages were asked for (in flight or read): more than one crop's
    assert len(at_first_crop) == 3 and at_first_crop[0] > CROP**3 * size, at_first_crop


def test_thread_workers_ask_item_by_item(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Threads share the transform: a batch's windows drawn ahead would miss the draws another thread makes
    meanwhile, so a thread other than the main one asks for each item's pages as it crops it."""
    import threading

    from loaders.faces.monai_crop import ask_batch_pages as real

    ds = _dropin(tmp_path, counted=False)[0]
    batched: list[str] = []

    def spy(*args: Any) -> int:
        batched.append(threading.current_thread().name)
        return int(real(*args))

    monkeypatch.setattr("loaders.faces.monai.ask_batch_pages", spy)
    worker = threading.Thread(target=ds.__getitems__, args=([0, 1],), name="thread-worker")
    worker.start()
    worker.join()
    assert batched == []
    assert len(ds.__getitems__([0, 1])) == 2 and batched == ["MainThread"]
