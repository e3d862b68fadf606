"""Smoke test: the `loaders` scenario runs end to end on tiny data and prints every row with its ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("monai")

from loaders.deps import cuda_available  # noqa: E402
from workflows import benchmark  # noqa: E402


@pytest.mark.parametrize("mode", ["--warm", "--cold"])
def test_bench_loaders_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str) -> None:
    argv = ["loaders", "--count", "3", "--size", "16", mode, "--region-size", "32", "--patch", "12", "--reps", "3",
            "--batchsize", "2", "--out", str(tmp_path)]  # fmt: skip
    assert benchmark.main(argv) == 0
    text = capsys.readouterr().out
    reference = "O_DIRECT x16, a request a tensor" if mode == "--cold" else "ceiling np.fromfile"
    for name in (reference, "PreparedDataset[posix] items", "PreparedDataset[posix] batches",
                 "MONAI PersistentDataset", "whole volume 32^3", "region 12^3 of it"):  # fmt: skip
        assert name in text, text
    rows = json.loads((tmp_path / "bench.json").read_text())["results"]
    assert all(r["seconds"] > 0 and r["nbytes"] > 0 for r in rows)
    ours = next(r for r in rows if r["name"] == "PreparedDataset[posix] batches")
    assert ours["items"] == 3 and ours["nbytes"] == 3 * 16**3 * (4 + 1) and ours["x_peer"] > 0
    region = next(r for r in rows if r["name"].startswith("region"))
    assert region["nbytes"] == 3 * 12**3 * 4 and region["peer"].startswith("whole volume")
    # the prepared cache is kept and reused by the next run with the same spec
    cache = tmp_path / "work" / "loaders" / "cache-3x16"
    stamp = (cache / "manifest.json").stat().st_mtime_ns
    assert benchmark.main(argv) == 0
    assert (cache / "manifest.json").stat().st_mtime_ns == stamp


def test_bench_loaders_gpu_rows_say_why_without_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if cuda_available():
        pytest.skip("a GPU is present: the GPU rows run instead")
    argv = ["loaders", "--count", "2", "--size", "8", "--device", "cuda:0", "--no-region", "--out", str(tmp_path)]
    assert benchmark.main(argv) == 0
    assert "unavailable: GPU rows:" in capsys.readouterr().out


def test_patch_larger_than_volume_is_refused(tmp_path: Path) -> None:
    assert benchmark.main(["loaders", "--region-size", "8", "--patch", "9", "--out", str(tmp_path)]) == 2
