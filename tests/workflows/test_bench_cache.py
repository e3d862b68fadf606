"""Smoke tests of the `cache` and `cache-scale` scenarios at tiny sizes (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loaders.format import PreparedCache
from workflows import benchmark


def _rows(out: Path) -> dict[str, dict]:  # type: ignore[type-arg]
    return {r["name"]: r for r in json.loads((out / "bench.json").read_text())["results"]}


@pytest.mark.slow
def test_bench_cache_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["cache", "--workloads", "spheres,seg-ct,mednist", "--count", "3", "--size", "16", "--images", "40",
            "--scaling", "2", "--modes", "auto,processes", "--out", str(tmp_path)]  # fmt: skip
    assert benchmark.main(argv) == 0, capsys.readouterr().out
    rows = _rows(tmp_path)
    for workload, n in (("spheres", 3), ("seg-ct", 3), ("mednist", 40)):
        ways = ("CacheDataset(num_workers=2)", "PersistentDataset + DataLoader(2)", "prep cache, 2 threads (auto)",
                "prep cache, 2 processes")  # fmt: skip
        for name in (f"{workload} W2: {way}" for way in ways):
            assert rows[name]["items"] == n and rows[name]["extra"]["CPU ms/item"] > 0, rows
        prep = rows[f"{workload} W2: prep cache, 2 processes"]
        assert prep["x_peer"] > 0 and 1.0 <= prep["extra"]["disk/tensor bytes"] < 2  # only alignment padding
    assert "x peer: against " in capsys.readouterr().out


def test_bench_cache_scale_smoke(tmp_path: Path) -> None:
    argv = ["cache-scale", "--items", "2000", "--sample", "500", "--out", str(tmp_path)]
    assert benchmark.main(argv) == 0
    rows = _rows(tmp_path)
    assert rows["open PreparedCache"]["extra"]["ms"] > 0
    assert rows["index lookup (entries)"]["items"] == 500 and rows["PreparedDataset[i], warm"]["extra"]["us/item"] > 0
    index = PreparedCache(tmp_path / "work" / "cache-scale-2000")
    assert len(index) == 2000 and index.entries(1999)[1].key == "label"
    assert index.meta(1234)["source"]["image"] == "case_0001234.nii.gz"
