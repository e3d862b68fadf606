"""Smoke test of the backend benchmark at a tiny size (no timing assertions: it must only keep working)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workflows import bench_backends


@pytest.mark.parametrize("mode", ["--cold", "--warm"])
def test_bench_runs_and_reports(tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--dir", str(tmp_path), "--size-mb", "2", "--files", "2", "--item-mb", "0.3", "--batch", "3"]
    results = bench_backends.main([*argv, "--threads", "2", mode, "--no-drop-caches", "--backends", "posix,direct"])
    out = capsys.readouterr().out
    names = [r.name for r in results]
    assert names[0].startswith("ceiling") and names[1:] == ["posix", "direct"]
    assert all(r.nbytes == 2 << 20 and r.seconds > 0 for r in results)  # every reader moved every byte
    assert "x ceiling" in out and ("cold" if mode == "--cold" else "warm") in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data-000.bin", "data-001.bin"]


def test_items_cover_the_files_exactly(tmp_path: Path) -> None:
    paths = bench_backends.make_files(tmp_path, 1, 3)
    items = bench_backends.items_of(paths, 100_000)
    for p in paths:
        mine = [r for r in items if r.path == str(p)]
        assert mine[0].offset == 0 and sum(r.nbytes for r in mine) == p.stat().st_size
        assert all(a.offset + a.nbytes == b.offset for a, b in zip(mine, mine[1:]))
