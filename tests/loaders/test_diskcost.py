"""The cold reads' cost model, measured on the disk the files lie on (or the default where it cannot be)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from loaders.backends import get_backend
from loaders.reading import diskcost
from loaders.reading.diskcost import COLD_COST, CostModel, disk_cost, measure
from loaders.reading.region import _grouped


def _files(tmp_path: Path, n: int, size: int) -> list[str]:
    paths = []
    for k in range(n):
        path = tmp_path / f"f{k}.bin"
        with open(path, "wb") as f:
            f.truncate(size)
        paths.append(str(path))
    return paths


def test_the_gap_worth_reading_is_a_requests_cost_in_bytes() -> None:
    assert CostModel(100e-6, 2e9).gap == 200_000 and CostModel(0.0, 1e9).gap == 0


def test_a_disk_is_measured_once_per_process_and_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _files(tmp_path, 2, 48 << 20)
    calls: list[int] = []

    def counting(*args: object) -> None:
        calls.append(1)
        _grouped(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(diskcost, "_MEASURED", {})
    try:
        backend = get_backend("direct")
    except Exception as exc:  # noqa: BLE001 - a filesystem without O_DIRECT
        pytest.skip(f"no O_DIRECT backend here: {exc}")
    with backend:
        first = disk_cost(backend, paths, 8, counting)
        again = disk_cost(backend, paths[::-1], 8, counting)
    assert first is again and first is not COLD_COST
    assert first.bandwidth_bps > 0 and first.request_s >= 0
    assert len(calls) == 2  # 4 KiB reads, then 1 MiB reads; none the second time
    assert (os.getpid(), os.stat(paths[0]).st_dev) in diskcost._MEASURED


def test_small_files_or_a_buffered_backend_keep_the_default(tmp_path: Path) -> None:
    small = _files(tmp_path, 1, 8 << 20)
    large = _files(tmp_path / "large", 1, 80 << 20) if (tmp_path / "large").mkdir() is None else []
    with get_backend("posix") as posix:
        assert disk_cost(posix, large, 8, _grouped) is COLD_COST  # buffered reads: the page cache, not the disk
        assert measure(posix, [(small[0], 8 << 20)], 8, _grouped) is None
