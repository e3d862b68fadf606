"""A crafted cache (checksums recomputed) never makes a reader read outside the cache directory, allocate
on an unchecked count, or serve one item's tensors as another's: each is one FormatError line on open, and
`prep verify` exits 1 with that line."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from craft import copy_cache, edit_index, reseal
from typer.testing import CliRunner

from loaders import FormatError, PreparedCache, PreparedDataset
from prep.cli import app


def _first_shard(cache: Path) -> str:
    return str(PreparedCache(cache).manifest["shards"][0])


def _rename_shard(name: str) -> Callable[[dict], None]:
    def edit(doc: dict) -> None:
        doc["shards"][0] = name

    return edit


def _refused(cache: Path, says: str) -> None:
    with pytest.raises(FormatError, match=says):
        PreparedDataset(cache)[0]
    result = CliRunner().invoke(app, ["verify", str(cache)])
    assert result.exit_code == 1, result.output
    assert says in result.output, result.output


@pytest.mark.parametrize("name", ["../../../../../../etc/passwd", "/etc/passwd", "shards/../../outside.bin"])
def test_shard_names_outside_the_cache_are_refused(good_cache: Path, tmp_path: Path, name: str) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    (tmp_path / "outside.bin").write_bytes(b"\0" * (1 << 20))
    reseal(cache, _rename_shard(name))
    _refused(cache, "outside the cache directory")


def test_a_symlinked_shard_leaving_the_cache_is_refused(good_cache: Path, tmp_path: Path) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    shard = cache / _first_shard(cache)
    shard.unlink()
    shard.symlink_to("/etc/passwd")
    _refused(cache, "outside the cache directory")
    shard.unlink()
    shard.symlink_to("/dev/zero")
    _refused(cache, "outside the cache directory")
    with pytest.raises(FormatError, match="not a regular file"):
        PreparedCache(cache, allow_outside=True)  # opting in still reads regular files only


def test_a_fifo_shard_is_refused_without_hanging(good_cache: Path, tmp_path: Path) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    shard = cache / _first_shard(cache)
    shard.unlink()
    os.mkfifo(shard)
    _refused(cache, "not a regular file")


def test_a_huge_item_count_is_refused_before_allocating(good_cache: Path, tmp_path: Path) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    reseal(cache, lambda doc: doc.update(n_items=300_000_000))
    _refused(cache, "n_items 300000000 but meta_offsets.npy has")


def _swap_items(rows: np.ndarray) -> None:
    rows["item"] = rows["item"][::-1].copy()


def _overlap(rows: np.ndarray) -> None:
    rows["offset"][1] = rows["offset"][0]
    rows["shard"][1] = rows["shard"][0]


def _wrap(rows: np.ndarray) -> None:
    rows["ndim"][0] = 4
    rows["shape"][0, :4] = [2**32, 2**32, 1, 1]  # 2^64 elements: a uint64 product wraps to 0
    rows["nbytes"][0] = 0


def _past_end(rows: np.ndarray) -> None:
    rows["offset"][-1] = rows["offset"][-1] + (1 << 30)


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (_swap_items, "not items"),
        (_overlap, "overlap"),
        (_wrap, "do not make its nbytes"),
        (_past_end, "past the end of its shard"),
    ],
    ids=["permuted-items", "overlapping-extents", "wrapping-shape", "extent-past-shard"],
)
def test_an_inconsistent_index_is_refused(good_cache: Path, tmp_path: Path, edit, says: str) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    edit_index(cache, edit)
    with pytest.raises(FormatError, match=says):
        PreparedDataset(cache)[0]
    result = CliRunner().invoke(app, ["verify", str(cache)])
    assert result.exit_code == 1, result.output
    if says != "past the end of its shard":  # verify lists the short tensors one by one instead
        assert says in result.output, result.output


def test_an_image_reshaped_against_its_label_is_not_cropped_through_the_label_fold(
    good_cache: Path, tmp_path: Path
) -> None:
    """An item's image reshaped (same bytes) so that its spatial shape no longer agrees with its label's, the
    manifest resealed: the label-driven crop is no longer folded into the read (one window for every key would
    be cut from a different shape); the crop runs in the tail, as MONAI runs it on that content."""
    from loaders.cache.format import PreparedCache
    from loaders.fast.folds import LabelCropFold, label_fold
    from prep.pipeline import load_pipeline

    tail = load_pipeline(Path(__file__).parents[2] / "workflows" / "pipelines" / "spheres.py").tail
    assert isinstance(label_fold(tail, PreparedCache(good_cache)), LabelCropFold)
    cache = copy_cache(good_cache, tmp_path / "c")

    def reshape(rows: np.ndarray) -> None:
        (at,) = np.flatnonzero((rows["item"] == 0) & (rows["key"] == 0))
        d, h, w = rows["shape"][at, 1:4]
        rows["shape"][at, 1:4] = [d * 2, h, w // 2]

    edit_index(cache, reshape)
    assert label_fold(tail, PreparedCache(cache)) is None
