"""Region reads equal full[slices] exactly and read only a fraction of the bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loaders.backends import get_backend
from loaders.cache.format import PreparedCache
from loaders.cache.writing import write_items
from loaders.reading.region import plan_region, read_region_entry


@st.composite
def regions(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int | None]:
    full = tuple(draw(st.lists(st.integers(1, 9), min_size=1, max_size=4)))
    start = tuple(draw(st.integers(0, f - 1)) for f in full)
    shape = tuple(draw(st.integers(1, f - s)) for f, s in zip(full, start))
    axis = draw(st.one_of(st.none(), st.integers(0, len(full) - 1)))
    return full, start, shape, axis


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=regions(), dtype=st.sampled_from(["uint8", "int16", "float32", "float64"]))
def test_region_equals_full_slices(tmp_path: Path, case: tuple, dtype: str) -> None:
    full, start, shape, axis = case
    array = (np.arange(int(np.prod(full))) % 251).astype(dtype).reshape(full)
    root = tmp_path / f"c{abs(hash((case, dtype)))}"
    cache = write_items(root, [{"x": array}])
    (entry,) = cache.entries(0)
    with get_backend("posix") as backend:
        got = read_region_entry(backend, entry, start, shape, axis)
    slices = tuple(slice(s, s + n) for s, n in zip(start, shape))
    np.testing.assert_array_equal(got, array[slices])
    assert got.dtype == array.dtype and got.flags.c_contiguous


def test_plan_reads_a_fraction_of_a_large_volume() -> None:
    plan = plan_region((256, 256, 256), 4, (80, 40, 100), (96, 96, 96))
    whole = 256**3 * 4
    assert plan.nbytes < whole / 5
    assert len(plan.spans) <= 96 * 96  # never worse than one request per row
    # a region spanning the full trailing dims is one contiguous run
    slab = plan_region((256, 256, 256), 4, (10, 0, 0), (96, 256, 256))
    assert len(slab.spans) == 1 and slab.nbytes == 96 * 256 * 256 * 4


def test_region_outside_the_tensor(tmp_path: Path) -> None:
    cache = write_items(tmp_path / "c", [{"x": np.zeros((4, 4), np.float32)}])
    with get_backend("posix") as backend, pytest.raises(ValueError, match="outside"):
        read_region_entry(backend, PreparedCache(cache.root).entries(0)[0], (2, 2), (3, 1))


class _Recording:
    """Records the requests a backend sees and the threads they run on."""

    def __init__(self) -> None:
        import threading

        self.lock = threading.Lock()
        self.requests: list[Any] = []
        self.threads: set[int] = set()


def _recording_backend(record: _Recording) -> Any:
    import threading

    from loaders.backends.posix import PosixBackend

    class RecordingBackend(PosixBackend):
        name = "recording"

        @property
        def page_cache_reads(self) -> bool:  # no copies out of a mapping: every read is to be recorded
            return False

        def read_into(self, requests: Any, buffers: Any) -> None:
            with record.lock:
                record.requests += list(requests)
                record.threads.add(threading.get_ident())
            super().read_into(requests, buffers)

    return RecordingBackend()


def _image_label(tmp_path: Path) -> tuple[dict, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    image = rng.random((1, 20, 18, 16), dtype=np.float32)
    label = rng.integers(0, 5, (1, 20, 18, 16), dtype=np.uint8)
    cache = write_items(tmp_path / "c", [{"image": image, "label": label}])
    return {e.key: e for e in cache.entries(0)}, image, label


@pytest.mark.parametrize("groups", [1, 2, 5])
def test_warm_runs_go_in_a_few_sequential_groups(tmp_path: Path, groups: int) -> None:
    from loaders.reading.region import plan_read, read_regions

    entries, image, label = _image_label(tmp_path)
    start, shape = (0, 3, 5, 2), (1, 9, 7, 11)
    reads = [plan_read(entries[k], start, shape, axis=3) for k in ("image", "label")]  # 2 x 63 runs
    record = _Recording()
    with _recording_backend(record) as backend:
        got = read_regions(backend, reads, warm=True, groups=groups)
    assert len(record.requests) == 2 * 9 * 7  # every run once, none merged
    assert len(record.threads) <= groups  # one thread per group: the handoff is paid per group
    slices = (slice(0, 1), slice(3, 12), slice(5, 12), slice(2, 13))
    np.testing.assert_array_equal(got[0], image[slices])
    np.testing.assert_array_equal(got[1], label[slices])


def test_cold_runs_merge_across_cheap_gaps(tmp_path: Path) -> None:
    from loaders.reading.region import CostModel, plan_read, read_regions

    array = np.random.default_rng(1).random((1, 4, 5, 2048), dtype=np.float32)  # rows of 8 KiB: pages apart
    (entry,) = write_items(tmp_path / "c", [{"x": array}]).entries(0)
    start, shape = (0, 1, 1, 100), (1, 2, 3, 200)
    reads = [plan_read(entry, start, shape, axis=3)]  # 6 runs of 800 bytes
    for cost, want in [(CostModel(1.0, 1e6), 1), (CostModel(0.0, 1e9), 6)]:
        record = _Recording()
        with _recording_backend(record) as backend:
            (got,) = read_regions(backend, reads, warm=False, cost=cost, inflight=4)
        # a huge request cost merges all runs into one read; a free one merges none
        assert len(record.requests) == want
        assert all(q.offset % 4096 == 0 and q.nbytes % 4096 == 0 for q in record.requests)  # whole pages
        np.testing.assert_array_equal(got, array[:, 1:3, 1:4, 100:300])


@pytest.mark.parametrize("gap_s", [0.0, 1.0])
def test_cold_regions_of_two_tensors(tmp_path: Path, gap_s: float) -> None:
    from loaders.reading.region import CostModel, plan_read, read_regions

    entries, image, label = _image_label(tmp_path)  # both in one shard: one merged read when gaps are cheap
    start, shape = (0, 3, 5, 2), (1, 9, 7, 11)
    reads = [plan_read(entries[k], start, shape) for k in ("image", "label")]
    with get_backend("posix") as backend:
        got = read_regions(backend, reads, warm=False, cost=CostModel(gap_s, 1e6))
    slices = (slice(0, 1), slice(3, 12), slice(5, 12), slice(2, 13))
    np.testing.assert_array_equal(got[0], image[slices])
    np.testing.assert_array_equal(got[1], label[slices])
    assert all(g.flags.c_contiguous for g in got)


def test_coalesce_keeps_files_apart_and_orders_runs() -> None:
    from loaders.backends import ReadRequest
    from loaders.reading.region import coalesce

    reqs = [ReadRequest("b", 0, 10), ReadRequest("a", 100, 10), ReadRequest("a", 0, 10), ReadRequest("a", 15, 5)]
    merged, places = coalesce(reqs, gap=5)
    assert merged == [ReadRequest("a", 0, 20), ReadRequest("a", 100, 10), ReadRequest("b", 0, 10)]
    assert places == [[2, 3], [1], [0]]
    assert coalesce(reqs, gap=4)[0][0] == ReadRequest("a", 0, 10)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    case=regions(),
    warm=st.booleans(),
    mapped=st.booleans(),
    gap=st.sampled_from([0, 7, 64, 1 << 20]),
    groups=st.integers(1, 6),
)
def test_every_schedule_equals_full_slices(
    tmp_path: Path, case: tuple, warm: bool, mapped: bool, gap: int, groups: int
) -> None:
    from loaders.reading.region import CostModel, plan_read, read_regions

    full, start, shape, axis = case
    array = (np.arange(int(np.prod(full))) % 241).astype(np.int16).reshape(full)
    root = tmp_path / f"s{abs(hash(case))}"
    if not root.exists():
        write_items(root, [{"x": array}])
    (entry,) = PreparedCache(root).entries(0)
    with get_backend("posix") as backend:
        (got,) = read_regions(
            backend,
            [plan_read(entry, start, shape, axis)],
            warm=warm,
            mapped=mapped,
            cost=CostModel(gap, 1.0),
            groups=groups,
        )
    np.testing.assert_array_equal(got, array[tuple(slice(s, s + n) for s, n in zip(start, shape))])


def test_warm_regions_come_from_a_mapping_that_follows_the_file(tmp_path: Path) -> None:
    import os

    from loaders.errors import BackendError
    from loaders.reading.region import plan_read, read_regions

    entries, image, _ = _image_label(tmp_path)
    start, shape = (0, 3, 5, 2), (1, 9, 7, 11)
    slices = (slice(0, 1), slice(3, 12), slice(5, 12), slice(2, 13))
    record = _Recording()
    with get_backend("posix") as backend:
        (got,) = read_regions(backend, [plan_read(entries["image"], start, shape)], warm=True)
        np.testing.assert_array_equal(got, image[slices])
        # rewritten in place (new mtime): the new bytes are seen, not the old mapping's
        e = entries["image"]
        with open(e.shard, "r+b") as f:
            f.seek(e.offset)
            f.write((image + 1).tobytes())
        os.utime(e.shard, ns=(1, 1))
        (got,) = read_regions(backend, [plan_read(e, start, shape)], warm=True)
        np.testing.assert_array_equal(got, image[slices] + 1)
        # shorter than the index: no mapped access past the end (SIGBUS); the backend names the short read
        os.truncate(e.shard, e.offset + 100)
        with pytest.raises(BackendError, match="short read"):
            read_regions(backend, [plan_read(e, start, shape)], warm=True)
    # a backend not known to read plain files is not bypassed
    with _recording_backend(record) as other, pytest.raises(BackendError):
        read_regions(other, [plan_read(e, start, shape)], warm=True)
    assert record.requests


@pytest.mark.parametrize("groups", [2, 3])
def test_mapped_copy_split_over_threads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, groups: int) -> None:
    import loaders.reading.region as region

    monkeypatch.setattr(region, "SEQUENTIAL_BELOW", 64)  # small regions take the threaded copy too
    entries, image, _ = _image_label(tmp_path)
    used: list[int] = []
    with get_backend("posix") as backend:
        (got,) = region.read_regions(
            backend,
            [region.plan_read(entries["image"], (0, 3, 5, 2), (1, 9, 7, 11))],
            allocate=lambda n: used.append(n) or np.zeros(n + 64, np.uint8),
            warm=True,
            groups=groups,
        )
    np.testing.assert_array_equal(got, image[:, 3:12, 5:12, 2:13])
    assert used == [9 * 7 * 11 * 4]  # the result lives in the caller's (pooled) memory
