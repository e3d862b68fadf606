"""Smoke test of workflows.bench_cache at tiny sizes, so the benchmark cannot rot (no timing asserted)."""

from __future__ import annotations

from pathlib import Path

import pytest

from loaders.format import PreparedCache
from workflows import bench_cache


@pytest.mark.slow
def test_bench_cache_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = bench_cache.run(
        count=3, size=16, workers=1, index_items=2000, pipeline=bench_cache.DEFAULT_PIPELINE, out=tmp_path,
        processes=False, rounds=2,
    )  # fmt: skip
    assert result["prep"]["items"] == result["persistent"]["items"] == 3  # the rounds' parts add up
    assert result["persistent"]["items_per_s"] > 0 and result["prep"]["items_per_s"] > 0
    assert result["speedup_vs_persistent"] > 0 and result["speedup_vs_persistent_1_thread"] > 0
    assert result["persistent_1_thread"]["torch_threads"] == 1
    assert result["persistent_dataloader"]["loader_workers"] == 1 and result["speedup_vs_persistent_dataloader"] > 0
    assert result["prep"]["mode"] == "threads" and len(result["load_before"]) == 3
    assert result["prep"]["cpu_ms_per_item"] > 0 and result["persistent_dataloader"]["cpu_ms_per_item"] > 0
    assert 1.0 <= result["disk_over_tensor_bytes"] < 1.5  # only alignment padding over the tensor bytes
    assert result["open"]["n_items"] == 2000
    index = PreparedCache(tmp_path / "index")
    assert len(index) == 2000 and index.entries(1999)[1].key == "label"
    assert index.meta(1234)["source"]["image"].endswith("case_0001234.nii.gz")
    assert "PersistentDataset first pass" in capsys.readouterr().out
