"""`cold-rate` runs tiny: the disk's row, the loader's cold epoch in a child, the ratio in the footer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from workflows import benchmark
from workflows.bench.memcg import cgroup_reason

TINY = ["--count", "6", "--size", "24", "--crop", "8", "--batchsize", "2"]


# 768 MiB: the child's imports alone take 290 MiB with torch 2.13's CPU build and 451 MiB with torch 2.3.1's CUDA
# build (resident at its peak), which a 256 MiB cgroup killed
@pytest.mark.parametrize("limit", ["0", "768"], ids=["no-cgroup", "in-a-cgroup"])
def test_cold_rate_prints_the_ratio(tmp_path: Path, capsys: pytest.CaptureFixture[str], limit: str) -> None:
    if limit != "0" and cgroup_reason():
        pytest.skip(cgroup_reason())
    status = benchmark.main(["cold-rate", *TINY, "--limit-mib", limit, "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "loader cold read / disk = " in printed
    rows = json.loads((tmp_path / "out" / "bench.json").read_text())["results"]
    loader = [r for r in rows if r["kind"] == "ours"]
    assert len(loader) == 1 and loader[0]["items"] == 6
    assert ("768 MiB memory cgroup" in loader[0]["note"]) == (limit != "0")
