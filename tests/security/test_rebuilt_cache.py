"""A reader notices a cache rebuilt under it (generation id in the manifest) and says so in one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from loaders.cache.format import PreparedCache
from loaders.cache.writing import write_items
from loaders.errors import FormatError


def _items(seed: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [{"image": rng.random((2, 8, 8), dtype=np.float32)} for _ in range(3)]


def test_rebuilt_cache_refused_per_epoch_and_per_read(tmp_path: Path) -> None:
    from loaders import PreparedDataset

    root = tmp_path / "c"
    write_items(root, _items(0))
    ds = PreparedDataset(root)
    ds[0]
    ds.set_epoch(1)  # unchanged: fine
    shutil.rmtree(root)
    write_items(root, _items(1))  # rebuilt at the same path
    for call in (lambda: ds.set_epoch(2), lambda: next(iter(ds.iter_batches(2))), lambda: ds.cache.meta(1),
                 lambda: ds.cache.entries(2)):  # fmt: skip
        with pytest.raises(FormatError) as info:
            call()
        msg = str(info.value)
        assert "\n" not in msg and f"the cache at {root.absolute()} was rebuilt" in msg and "reopen it" in msg


def test_removed_manifest_refused(tmp_path: Path) -> None:
    root = tmp_path / "c"
    cache = write_items(root, _items(0))
    assert cache.generation and PreparedCache(root).generation == cache.generation
    (root / "manifest.json").unlink()
    with pytest.raises(FormatError, match="was rebuilt .or removed. since this reader opened it"):
        cache.meta(0)


def test_each_commit_gets_a_new_generation(tmp_path: Path) -> None:
    a = write_items(tmp_path / "a", _items(0)).generation
    b = write_items(tmp_path / "b", _items(0)).generation
    assert isinstance(a, str) and len(a) == 16 and a != b


def test_items_read_before_and_the_loader_s_next_epoch_are_refused(good_cache: Path, tmp_path: Path) -> None:
    """`prep cache --force` under running readers. An item read before (its plan kept, its shard
    descriptor open) is refused like the others, and PreparedLoader's next epoch is refused at its start,
    even where every item is held in memory: no reader goes on with the old generation."""
    from monai.transforms import Compose, RandFlipd

    from loaders import PreparedDataset, PreparedLoader
    from prep.cache import prepare_cache
    from prep.pipeline import load_pipeline

    spheres = Path(__file__).resolve().parents[2] / "workflows" / "pipelines" / "spheres.py"
    cache = tmp_path / "cache"
    shutil.copytree(good_cache, cache)
    transform = Compose([*load_pipeline(spheres).head, RandFlipd(keys=["image", "label"], prob=0.5)])
    ds = PreparedDataset(cache)
    ds[0]
    loader = PreparedLoader(cache, transform, 1, device="cpu", shuffle=False)
    assert len(list(loader)) == len(ds)
    datalist = Path(PreparedCache(cache).manifest["datalist"])
    prepare_cache(datalist, spheres, cache, workers=1, processes=False, force=True)
    for call in (lambda: ds[0], lambda: ds[1], lambda: list(loader)):
        with pytest.raises(FormatError, match="was rebuilt .or removed. since this reader opened it; reopen it"):
            call()
