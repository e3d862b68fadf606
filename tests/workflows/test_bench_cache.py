"""Smoke tests of the `cache` and `cache-scale` scenarios at tiny sizes (no timing asserted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import typer

from loaders.cache.format import PreparedCache
from workflows import benchmark
from workflows.bench.cache import worker_counts


def _rows(out: Path) -> dict[str, dict]:  # type: ignore[type-arg]
    return {r["name"]: r for r in json.loads((out / "bench.json").read_text())["results"]}


@pytest.mark.slow
def test_bench_cache_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Every workload at two worker counts: both MONAI ways and prep cache in one run, the curve after it."""
    argv = ["cache", "--count", "3", "--size", "16", "--images", "40", "--scaling", "1,2", "--modes",
            "auto,processes", "--out", str(tmp_path)]  # fmt: skip
    assert benchmark.main(argv) == 0, capsys.readouterr().out
    rows = _rows(tmp_path)
    for workload, n in (("spheres", 3), ("seg-ct", 3), ("mednist", 40)):
        for w in (1, 2):
            data = f"{workload} W{w}"
            ways = [f"CacheDataset(num_workers={w})", f"PersistentDataset + DataLoader({w})", f"{w} processes"]
            mine = {name: r for name, r in rows.items() if r["data"] == data}
            for (
                way
            ) in ways:  # prep cache's mode may say how many items each worker runs at once: "1 processes x 2 items"
                name = next(k for k in mine if k.endswith(way) or f"{way} x " in k)
                assert mine[name]["items"] == n and mine[name]["extra"]["CPU ms/item"] > 0, rows
            auto = [r for k, r in mine.items() if k.endswith("(auto)")]
            assert len(auto) == 1 and auto[0]["items"] == n, sorted(mine)
            prep = next(r for k, r in mine.items() if k.startswith(f"{data}: prep cache, {w} processes"))
            assert prep["x_peer"] > 0 and 1.0 <= prep["extra"]["disk/tensor bytes"] < 2  # only alignment padding
    footer = json.loads((tmp_path / "bench.json").read_text())["footer"]
    curve = [line.split() for line in footer[2:]]
    assert {(c[0], c[1]) for c in curve} == {(w, n) for w in ("spheres", "seg-ct", "mednist") for n in "12"}
    assert len(curve) == 12 and all(float(c[-1]) > 0 for c in curve), footer
    out = capsys.readouterr().out
    assert "x peer: against " in out and "x best MONAI" in out


def test_worker_counts_are_capped_at_the_cores() -> None:
    assert worker_counts("1,4,8,16", cores=16) == [1, 4, 8, 16]
    assert worker_counts("1,4,8,16", cores=2) == [1, 2]
    assert worker_counts("8,1", cores=4) == [1, 4]
    for bad in ("", "0,2", "two"):
        with pytest.raises(typer.BadParameter):
            worker_counts(bad, cores=4)


def test_bench_cache_scale_smoke(tmp_path: Path) -> None:
    argv = ["cache-scale", "--items", "2000", "--sample", "500", "--out", str(tmp_path)]
    assert benchmark.main(argv) == 0
    rows = _rows(tmp_path)
    assert rows["open PreparedCache"]["extra"]["ms"] > 0
    assert rows["index lookup (entries)"]["items"] == 500 and rows["PreparedDataset[i], warm"]["extra"]["us/item"] > 0
    index = PreparedCache(tmp_path / "work" / "cache-scale-2000")
    assert len(index) == 2000 and index.entries(1999)[1].key == "label"
    assert index.meta(1234)["source"]["image"] == "case_0001234.nii.gz"
