"""The drop-in benchmark runs end to end on CPU at a tiny size (it cannot rot); no timing is asserted."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from workflows import benchmark

pytest.importorskip("monai")


def test_dropin_rows_pair_ours_with_persistent_dataset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["dropin", "--size", "24", "--crop", "16", "--count", "4", "--reps", "1", "--batchsize", "2"]
    status = benchmark.main([*argv, "--workers", "1", "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert status == 0, printed
    with open(tmp_path / "out" / "bench.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 8, [r["name"] for r in rows]  # 2 loaders x 2 track_meta x (peer, ours)
    for ours in (r for r in rows if r["kind"] == "ours"):
        peer = next(r for r in rows if r["kind"] == "peer" and r["data"] == ours["data"])
        assert peer["name"].startswith("monai PersistentDataset") and int(ours["items"]) == int(peer["items"]) == 4
        assert float(ours["x_peer"]) > 0 and "ms/item" in ours["note"]
