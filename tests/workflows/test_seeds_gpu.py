"""The GPU box's seed script (`workflows.seeds_gpu`) on its CPU path, at tiny sizes, so it cannot rot."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

pytest.importorskip("torch")
pytest.importorskip("monai")


def test_seed_script_cpu_path(tmp_path: Path) -> None:
    from workflows.seeds_gpu import app

    args = ["--device", "cpu", "--count", "3", "--size", "20", "--epochs", "2", "--workers", "2", "--images", "8"]
    result = CliRunner().invoke(app, [*args, "--rounds", "1", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ok"] and summary["prep_cache"]["exit"] == 0 and summary["prep_cache"]["quarantined"] == 0
    loaders = summary["loaders"]
    assert set(loaders["rows"]) == {"PersistentDataset", "PreparedPersistentDataset"}  # GDSDataset needs a GPU
    assert "cuda" in loaders["gds_skipped"]
    assert loaders["differences"] == {"PreparedPersistentDataset": []} and loaders["drop_in_on_head_device"]
    ours = loaders["rows"]["PreparedPersistentDataset"]
    assert len(ours["seconds"]) == 2 and len(ours["x PersistentDataset per epoch"]) == 2
    assert ours["outputs"]["image"] == "MetaTensor torch.float32 cpu"
    dali = summary["dali"]
    if "skipped" not in dali:  # DALI installed: its CPU decoder ran, every way's labels equal readers.file's
        assert dali["exit"] == 0 and "dali readers.file" in dali["rows"]
