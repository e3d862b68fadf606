"""`prep bricks`: every tensor in blocks, resumed after an interruption, never made of damaged bytes, dropped
when the cache is committed again."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from cacheutil import SPHERES
from typer.testing import CliRunner

from loaders.cache.bricks import to_bricks
from loaders.cache.format import PreparedCache
from loaders.cache.writing import write_items
from loaders.errors import ChecksumError
from prep.bricks import build_bricks
from prep.cache import prepare_cache
from prep.cli import app


def _cache(root: Path, n: int = 4) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    items = [
        {"image": rng.random((1, 19, 23, 29), dtype=np.float32), "label": rng.integers(0, 3, (1, 19, 23, 29), np.uint8)}
        for _ in range(n)
    ]
    write_items(root, items)
    return items


def _prepared(nifti_dataset: Path, root: Path) -> list[dict[str, np.ndarray]]:
    """A cache `prep cache` made with two workers (several shards), and its tensors as the shards hold them."""
    summary = prepare_cache(nifti_dataset, SPHERES, root, workers=2, processes=False)
    assert summary.n_items == 6
    cache = PreparedCache(root)
    assert len(cache.shards) > 1
    return [
        {e.key: np.fromfile(e.shard, e.dtype, int(np.prod(e.shape)), offset=e.offset).reshape(e.shape)
         for e in cache.entries(i)}
        for i in range(len(cache))
    ]  # fmt: skip


def _blocks_equal(root: Path, items: list[dict[str, np.ndarray]]) -> None:
    cache = PreparedCache(root)
    for item, arrays in enumerate(items):
        for entry in cache.entries(item):
            brick = cache.bricks.of(entry)
            raw = np.fromfile(brick.path, np.uint8, brick.nbytes, offset=brick.offset).view(entry.dtype)
            want = to_bricks(arrays[entry.key], brick.block)
            np.testing.assert_array_equal(raw.reshape(*brick.grid, *brick.block), want)


def test_prep_bricks_writes_every_tensor_in_blocks(nifti_dataset: Path, tmp_path: Path) -> None:
    items = _prepared(nifti_dataset, tmp_path / "c")
    result = CliRunner().invoke(app, ["bricks", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert "12 tensors in blocks of 4096 bytes" in result.output
    _blocks_equal(tmp_path / "c", items)
    shards = len(PreparedCache(tmp_path / "c").shards)
    files = [f"{n:05d}.bin" for n in range(shards)]
    assert sorted(os.listdir(tmp_path / "c" / "bricks")) == [*files, "bricks.npy", "manifest.json"]
    assert not (tmp_path / "c" / "bricks.tmp").exists()


def test_a_new_commit_of_the_cache_drops_its_bricks(nifti_dataset: Path, tmp_path: Path) -> None:
    _prepared(nifti_dataset, tmp_path / "c")
    build_bricks(tmp_path / "c")
    prepare_cache(nifti_dataset, SPHERES, tmp_path / "c", workers=1, processes=False, force=True)
    assert not (tmp_path / "c" / "bricks").exists() and PreparedCache(tmp_path / "c").bricks is None


def test_current_bricks_are_kept_and_force_makes_them_again(tmp_path: Path) -> None:
    _cache(tmp_path / "c")
    out = build_bricks(tmp_path / "c")
    made = os.stat(out / "manifest.json").st_mtime_ns
    assert os.stat(build_bricks(tmp_path / "c") / "manifest.json").st_mtime_ns == made
    assert os.stat(build_bricks(tmp_path / "c", force=True) / "manifest.json").st_mtime_ns != made


def test_an_interrupted_run_resumes_after_the_files_it_finished(nifti_dataset: Path, tmp_path: Path) -> None:
    items = _prepared(nifti_dataset, tmp_path / "c")
    per_shard = int(np.count_nonzero(PreparedCache(tmp_path / "c").index["shard"] == 0))
    count = [0]

    def stop_midway(n: int) -> None:
        count[0] += n
        if count[0] == per_shard + 1:  # the first file finished, the second begun
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_bricks(tmp_path / "c", progress=stop_midway)
    finished = sorted(p.name for p in (tmp_path / "c" / "bricks.tmp").glob("*.rows.npy"))
    assert finished and not (tmp_path / "c" / "bricks").exists()
    again: list[int] = []
    build_bricks(tmp_path / "c", progress=again.append)
    assert len(again) == 12 - per_shard  # the finished file was not written again
    _blocks_equal(tmp_path / "c", items)


def test_a_damaged_tensor_is_never_cut_into_blocks(tmp_path: Path) -> None:
    _cache(tmp_path / "c")
    entry = PreparedCache(tmp_path / "c").entries(2)[0]
    with open(entry.shard, "r+b") as f:
        f.seek(entry.offset + 100)
        f.write(b"\xff\xff\xff\xff")
    with pytest.raises(ChecksumError, match="item 2 key 'image' fails its checksum"):
        build_bricks(tmp_path / "c")
    assert not (tmp_path / "c" / "bricks").exists()


def test_a_page_not_of_whole_pages_is_refused(tmp_path: Path) -> None:
    _cache(tmp_path / "c", n=1)
    result = CliRunner().invoke(app, ["bricks", str(tmp_path / "c"), "--page", "1000"])
    assert result.exit_code == 1 and "multiple of 4096" in result.output


def test_a_larger_page_makes_larger_blocks(tmp_path: Path) -> None:
    items = _cache(tmp_path / "c", n=2)
    build_bricks(tmp_path / "c", page=16384)
    cache = PreparedCache(tmp_path / "c")
    brick = cache.bricks.of(cache.entries(0)[0])
    assert brick.block_bytes == 16384 and cache.bricks.page == 16384
    _blocks_equal(tmp_path / "c", items)


def test_prep_verify_checks_the_blocks_against_the_tensors(tmp_path: Path) -> None:
    from prep.cache_verify import verify_cache

    _cache(tmp_path / "c", n=2)
    build_bricks(tmp_path / "c")
    assert verify_cache(tmp_path / "c") == []
    cache = PreparedCache(tmp_path / "c")
    brick = cache.bricks.of(cache.entries(1)[0])
    with open(brick.path, "r+b") as f:  # an edit the bricks' own checks cannot see: the rows keep their sizes
        f.seek(brick.offset + 8)
        f.write(b"\x01\x02\x03\x04")
    (bad,) = verify_cache(tmp_path / "c")
    assert (bad.item, bad.key, bad.shard) == (1, "image", "bricks/00000.bin") and "prep bricks --force" in bad.reason
