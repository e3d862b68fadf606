"""Cold region reads from a cache's bricks equal full[slices] exactly, and read fewer bytes than whole pages of
C-order rows; a damaged or edited bricks folder is refused in one line."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loaders.backends import get_backend
from loaders.cache.bricks import BRICK_DTYPE, BrickEntry, block_for, grid_of, to_bricks
from loaders.cache.checksums import doc_checksum
from loaders.cache.format import PreparedCache, TensorEntry
from loaders.cache.writing import write_items
from loaders.errors import FormatError
from loaders.reading.region import CostModel, plan_read, read_regions
from prep.bricks import build_bricks


@st.composite
def regions(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    full = tuple(draw(st.lists(st.integers(1, 40), min_size=1, max_size=4)))
    start = tuple(draw(st.integers(0, f - 1)) for f in full)
    shape = tuple(draw(st.integers(1, f - s)) for f, s in zip(full, start))
    return full, start, shape


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    case=regions(),
    dtype=st.sampled_from(["uint8", "int16", "float32", "float64"]),
    gap=st.sampled_from([0, 4096, 1 << 40]),
)
def test_a_cold_region_read_from_bricks_equals_full_slices(tmp_path: Path, case: tuple, dtype: str, gap: int) -> None:
    full, start, shape = case
    array = (np.arange(math.prod(full)) % 251).astype(dtype).reshape(full)
    root = tmp_path / f"c{abs(hash((case, dtype)))}"
    write_items(root, [{"x": array}])
    build_bricks(root)
    cache = PreparedCache(root)
    (entry,) = cache.entries(0)
    read = plan_read(entry, start, shape, brick=cache.bricks.of(entry))
    assert type(read.cold()).__name__ == "BrickRead"
    cost = CostModel(gap, 1.0)  # runs read alone, merged across a block's gap, or all read as one
    with get_backend("posix") as backend:
        (got,) = read_regions(backend, [read], warm=False, cost=cost, bricks=True)
    np.testing.assert_array_equal(got, array[tuple(slice(s, s + n) for s, n in zip(start, shape))])
    assert got.dtype == array.dtype and got.flags.c_contiguous


@pytest.mark.parametrize("seed", range(4))
def test_runs_anywhere_in_a_buffer_gather_into_the_region(seed: int) -> None:
    """Each run of blocks at its own place (uneven spacing: a group's runs at no one stride) still makes the
    region."""
    rng = np.random.default_rng(seed)
    array = rng.random((2, 30, 37, 41), dtype=np.float32)
    block = block_for(array.shape, 4)
    grid = grid_of(array.shape, block)
    blocks = to_bricks(array, block)
    entry = TensorEntry(0, "x", "s", 0, array.nbytes, array.dtype, array.shape, 0, 0)
    brick = BrickEntry("b", 0, blocks.nbytes, block, grid, 0)
    start, shape = (1, 3, 5, 2), (1, 20, 30, 33)
    read = plan_read(entry, start, shape, brick=brick).cold()
    raw = blocks.view(np.uint8).reshape(-1)
    buf = np.zeros(raw.nbytes * 3, np.uint8)
    places, at = [], 0
    for off, n, _ in read.runs:
        at += int(rng.integers(0, 3)) * 4  # a few bytes more or less between runs: every stride differs
        buf[at : at + n] = raw[off : off + n]
        places.append(at)
        at += n
    got = read.gather(buf, places)
    np.testing.assert_array_equal(got, array[tuple(slice(s, s + n) for s, n in zip(start, shape))])


def test_bricks_are_the_blocks_in_grid_order() -> None:
    array = np.arange(5 * 6, dtype=np.int16).reshape(5, 6)
    bricks = to_bricks(array, (2, 4))
    assert bricks.shape == (3, 2, 2, 4)
    np.testing.assert_array_equal(bricks[1, 0], array[2:4, 0:4])
    np.testing.assert_array_equal(bricks[2, 1], [[28, 29, 0, 0], [0, 0, 0, 0]])  # edges zero-padded


@pytest.mark.parametrize(
    ("shape", "itemsize", "block"),
    [((1, 200, 200, 200), 4, (1, 8, 8, 16)), ((1, 200, 200, 200), 1, (1, 16, 16, 16)), ((3, 4), 4, (3, 4))],
)
def test_a_block_is_a_page_of_the_spatial_axes(shape: tuple, itemsize: int, block: tuple) -> None:
    assert block_for(shape, itemsize) == block


def _bytes_of(requests: list[Any]) -> int:
    pages = set()
    for q in requests:
        pages.update(range(q.offset // 4096, (q.offset + q.nbytes - 1) // 4096 + 1))
    return len(pages) * 4096


@pytest.mark.parametrize(("dtype", "most"), [("float32", 1.45), ("uint8", 1.65)])
def test_a_crop_reads_its_blocks_where_c_order_reads_rows_of_pages(dtype: str, most: float) -> None:
    """A 96^3 crop of a 200^3 volume: the blocks it touches are <= `most` x its bytes (C order: > 2x)."""
    full, crop, item = (1, 200, 200, 200), (1, 96, 96, 96), np.dtype(dtype).itemsize
    entry = TensorEntry(0, "image", "shard", 0, math.prod(full) * item, np.dtype(dtype), full, 0, 0)
    block = block_for(full, item)
    grid = grid_of(full, block)
    brick = BrickEntry("bricks", 0, math.prod(grid) * math.prod(block) * item, block, grid, 0)
    rng = np.random.default_rng(0)
    blocks, rows = [], []
    for _ in range(100):
        start = (0, *(int(rng.integers(0, f - c + 1)) for f, c in zip(full[1:], crop[1:])))
        read = plan_read(entry, start, crop, brick=brick)
        blocks.append(_bytes_of(read.cold().requests()))
        rows.append(_bytes_of(read.requests()))
    need = math.prod(crop) * item
    assert np.mean(blocks) <= most * need
    assert np.mean(rows) > 2 * need


def _with_bricks(root: Path, array: np.ndarray) -> tuple[PreparedCache, TensorEntry]:
    """A cache of one tensor with its bricks, and the tensor's entry."""
    write_items(root, [{"x": array}])
    build_bricks(root)
    cache = PreparedCache(root)
    return cache, cache.entries(0)[0]


def _recording(backend: Any, seen: list[str]) -> None:
    """Every path `backend` reads from, noted in `seen` (the request's own file, one entry a call)."""
    real = backend.read_into

    def recording(requests: Any, targets: Any) -> None:
        seen.append(requests[0].path)
        real(requests, targets)

    backend.read_into = recording


def test_a_warm_region_is_read_from_the_cache_itself(tmp_path: Path) -> None:
    array = np.arange(40 * 40, dtype=np.float32).reshape(1, 40, 40)
    cache, entry = _with_bricks(tmp_path / "c", array)
    seen: list[str] = []
    with get_backend("posix") as backend:
        _recording(backend, seen)
        read = plan_read(entry, (0, 3, 4), (1, 10, 10), brick=cache.bricks.of(entry))
        (warm,) = read_regions(backend, [read], warm=True, mapped=False)
        (cold,) = read_regions(backend, [read], warm=False, bricks=True)
    np.testing.assert_array_equal(warm, cold)
    assert any("/shards/" in p for p in seen) and any("/bricks/" in p for p in seen)


def _made(tmp_path: Path) -> Path:
    root = tmp_path / "c"
    write_items(root, [{"x": np.ones((1, 20, 20, 20), np.float32)}, {"x": np.zeros((1, 20, 20, 20), np.float32)}])
    build_bricks(root)
    return root


def _edit_manifest(root: Path, **change: Any) -> None:
    path = root / "bricks" / "manifest.json"
    doc = {**json.loads(path.read_text()), **change}
    doc["checksum"] = doc_checksum(doc)
    path.write_text(json.dumps(doc))


def _edit_rows(root: Path, field: str, value: Any) -> None:
    from loaders.cache.checksums import file_record

    path = root / "bricks" / "bricks.npy"
    rows = np.load(path)
    rows[field][1] = value
    np.save(path, rows)
    _edit_manifest(root, index=file_record(path))


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda r: (r / "bricks" / "bricks.npy").write_bytes(b"x" * 200), "bytes, the manifest says"),
        (lambda r: _edit_manifest(r, cache="0" * 16), "another build of the cache"),
        (lambda r: _edit_manifest(r, schema="9"), "bricks schema '9'"),
        (lambda r: (r / "bricks" / "manifest.json").write_text("{"), "not valid JSON"),
        (lambda r: _edit_rows(r, "offset", 1 << 40), "runs past the end"),
        (lambda r: _edit_rows(r, "offset", 0), "overlap"),
        (lambda r: _edit_rows(r, "block", [1, 64, 64, 64, 0, 0]), "not within its tensor's dims"),
        (lambda r: _edit_rows(r, "nbytes", 4096), "does not fit its tensor"),
        (lambda r: _edit_rows(r, "file", 7), "missing or not listed"),
        (lambda r: os.truncate(r / "bricks" / "00000.bin", 4096), "runs past the end"),
    ],
)
def test_damaged_bricks_are_refused_in_one_line(tmp_path: Path, damage: Any, said: str) -> None:
    root = _made(tmp_path)
    damage(root)
    with pytest.raises(FormatError, match=said) as caught:
        _ = PreparedCache(root).bricks
    assert "\n" not in str(caught.value) and "prep bricks --force" in str(caught.value)


def test_a_bricks_file_that_is_a_link_is_refused(tmp_path: Path) -> None:
    root = _made(tmp_path)
    (tmp_path / "elsewhere.bin").write_bytes((root / "bricks" / "00000.bin").read_bytes())
    (root / "bricks" / "00000.bin").unlink()
    (root / "bricks" / "00000.bin").symlink_to(tmp_path / "elsewhere.bin")
    with pytest.raises(FormatError, match="outside the cache directory|symlink"):
        _ = PreparedCache(root).bricks


def test_the_rows_follow_the_layout() -> None:
    assert BRICK_DTYPE.names == ("file", "offset", "nbytes", "block", "xxh3")


def test_the_first_cold_reads_try_both_ways_then_keep_the_faster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loaders.reading import diskcost

    monkeypatch.setattr(diskcost, "_TRIALS", {})
    array = np.arange(64**3, dtype=np.float32).reshape(1, 64, 64, 64)
    cache, entry = _with_bricks(tmp_path / "c", array)
    seen: list[str] = []
    with get_backend("posix") as backend:
        _recording(backend, seen)
        read = plan_read(entry, (0, 5, 6, 7), (1, 24, 24, 24), brick=cache.bricks.of(entry))
        per_read = []
        for _ in range(9):
            before = len(seen)
            (got,) = read_regions(backend, [read], warm=False, cost=CostModel(0.0, 1e9))
            np.testing.assert_array_equal(got, array[:, 5:29, 6:30, 7:31])
            per_read.append({"bricks" if "/bricks/" in p else "shards" for p in seen[before:]})
    assert per_read[:6] == [{"bricks"}, {"shards"}] * 3  # in turn, the bricks first
    trial = diskcost.brick_trial(str(tmp_path / "c" / "bricks"))
    kept = "bricks" if trial.chosen else "shards"
    assert trial.chosen is not None and per_read[6:] == [{kept}] * 3


def test_a_trial_keeps_the_way_with_fewer_seconds_per_byte() -> None:
    from loaders.reading.diskcost import BrickTrial

    trial = BrickTrial(rounds=2)
    for way, seconds in [(True, 2.0), (False, 1.0), (True, 2.2), (False, 0.9)]:
        assert trial.pick() is way
        trial.record(way, seconds, 100)
    assert trial.chosen is False and trial.pick() is False
    trial.record(True, 0.0, 100)  # after the choice, nothing changes it
    assert trial.chosen is False
