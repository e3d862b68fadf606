"""Smoke test of the `backends` scenario at a tiny size (no timing assertions: it must only keep working)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workflows import benchmark
from workflows.bench import backends


@pytest.mark.parametrize("mode", ["--cold", "--warm"])
def test_bench_runs_and_reports(tmp_path: Path, mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["backends", "--dir", str(tmp_path / "data"), "--size-mb", "2", "--files", "2", "--item-mb", "0.3",
            "--batchsize", "3", "--threads", "2", mode, "--backends", "posix,direct",
            "--out", str(tmp_path / "o")]  # fmt: skip
    assert benchmark.main(argv) == 0
    out = capsys.readouterr().out
    rows = json.loads((tmp_path / "o" / "bench.json").read_text())["results"]
    names = [r["name"] for r in rows]
    assert names[0].startswith("ceiling") and names[1:] == ["posix", "direct"]
    assert all(r["nbytes"] == 2 << 20 and r["seconds"] > 0 for r in rows)  # every reader moved every byte
    assert all(r["x_ceiling"] > 0 for r in rows)
    assert "x ceiling" in out and ("cold" if mode == "--cold" else "warm") in out
    assert sorted(p.name for p in (tmp_path / "data").iterdir()) == ["data-000.bin", "data-001.bin"]


def test_items_cover_the_files_exactly(tmp_path: Path) -> None:
    paths = backends.make_files(tmp_path, 1, 3)
    items = backends.items_of(paths, 100_000)
    for p in paths:
        mine = [r for r in items if r.path == str(p)]
        assert mine[0].offset == 0 and sum(r.nbytes for r in mine) == p.stat().st_size
        assert all(a.offset + a.nbytes == b.offset for a, b in zip(mine, mine[1:]))
