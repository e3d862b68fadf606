"""Region reads equal full[slices] exactly and read only a fraction of the bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loaders.backends import get_backend
from loaders.format import PreparedCache, write_items
from loaders.region import plan_region, read_region_entry


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


def test_regions_of_several_tensors_in_one_backend_batch(tmp_path: Path) -> None:
    from loaders.backends.posix import PosixBackend
    from loaders.region import plan_read, read_regions

    class CountingBackend(PosixBackend):
        name = "counting"  # not "posix": no inline shortcut, so every region goes in one read_into
        calls = 0

        def read_into(self, requests: Any, buffers: Any) -> None:
            CountingBackend.calls += 1
            super().read_into(requests, buffers)

    rng = np.random.default_rng(0)
    image = rng.random((1, 20, 18, 16), dtype=np.float32)
    label = rng.integers(0, 5, (1, 20, 18, 16), dtype=np.uint8)
    cache = write_items(tmp_path / "c", [{"image": image, "label": label}])
    entries = {e.key: e for e in cache.entries(0)}
    start, shape = (0, 3, 5, 2), (1, 9, 7, 11)
    reads = [plan_read(entries[k], start, shape) for k in ("image", "label")]
    with CountingBackend() as backend:
        got = read_regions(backend, reads)
    assert CountingBackend.calls == 1
    slices = (slice(0, 1), slice(3, 12), slice(5, 12), slice(2, 13))
    np.testing.assert_array_equal(got[0], image[slices])
    np.testing.assert_array_equal(got[1], label[slices])
