"""Smoke test of workflows.bench_bmap on a tiny tree, so the benchmark cannot rot."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from workflows import bench_bmap


@pytest.mark.loopdev
def test_bench_bmap_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4") or not Path("/dev/loop-control").exists():
        pytest.skip("bench_bmap needs root, mkfs.ext4 and loop devices")
    rows = bench_bmap.run(files=60, workers=2, threads=4, mean_size=3000, tmp=tmp_path, repeat=1)
    names = {r.what for r in rows}
    assert {"filefrag -s -e, 1 process", "build_bmap, 1 worker(s)", "build_bmap, 2 workers"} <= names
    assert {"O_DIRECT 1 MiB requests, 4 in flight", "O_DIRECT at the files' offsets, 4 in flight"} <= names
    compared = [r for r in rows if r.ratio is not None]
    assert len(compared) == 12 and all((r.ratio or 0) > 0 and r.peer for r in compared)
    assert all(r.count == 60 for r in rows if r.what.startswith(("build_bmap", "BlockdevBackend")))
    assert list(tmp_path.iterdir()) == []  # image and mountpoint removed
    bench_bmap.print_table(rows)
    out = capsys.readouterr().out
    assert out.count("x filefrag") == 3 and out.count("x O_DIRECT at offsets") == 3
    assert "later epoch (checked once)" in out
