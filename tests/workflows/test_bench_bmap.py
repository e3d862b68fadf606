"""Smoke tests of the `bmap` and `bmap-scale` scenarios on tiny trees, so the benchmarks cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fsutil import loop_reason

from workflows import benchmark


def _need_loop() -> None:
    reason = loop_reason("ext4")
    if reason:
        pytest.skip(f"the bmap scenarios need an ext4 loop image: {reason}")


@pytest.mark.loopdev
def test_bench_bmap_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _need_loop()
    (tmp_path / "img").mkdir()
    argv = ["bmap", "--files", "60", "--workers", "2", "--threads", "4", "--mean-size", "3000",
            "--tmp", str(tmp_path / "img"), "--repeat", "1", "--out", str(tmp_path / "out")]  # fmt: skip
    assert benchmark.main(argv) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "out" / "bench.json").read_text())["results"]}
    assert {"filefrag -s -e, 1 process", "build_bmap, 1 worker", "build_bmap, 2 workers"} <= set(rows)
    assert {"O_DIRECT 1 MiB requests, 4 in flight", "O_DIRECT at the files' offsets, 4 in flight"} <= set(rows)
    ours = [r for r in rows.values() if r["kind"] == "ours"]
    assert len(ours) == 5 and all(r["x_peer"] > 0 and r["items"] == 60 for r in ours)
    assert all(r["x_ceiling"] > 0 for r in ours if r["data"] == "raw reads")
    assert list((tmp_path / "img").iterdir()) == []  # image and mountpoint removed
    out = capsys.readouterr().out
    assert "x peer: against filefrag -s -e, 1 process (mapping)" in out and "later epoch (checked once)" in out


@pytest.mark.loopdev
def test_bench_bmap_scale_smoke(tmp_path: Path) -> None:
    _need_loop()
    (tmp_path / "img").mkdir()
    argv = ["bmap-scale", "--files", "2000", "--mean-size", "512", "--workers", "2", "--tmp", str(tmp_path / "img"),
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert benchmark.main(argv) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "out" / "bench.json").read_text())["results"]}
    for w in (1, 2):
        row = rows[f"prep bmap --workers {w}"]
        assert row["items"] == 2000 and row["x_peer"] > 0 and row["extra"]["peak MB"] > 10
    assert list((tmp_path / "img").iterdir()) == []
