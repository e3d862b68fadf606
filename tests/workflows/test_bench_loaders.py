"""Smoke test: the loader benchmark runs end to end on tiny data and prints every row with its ratios."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("monai")

from workflows import bench_loaders  # noqa: E402


@pytest.mark.parametrize("mode", ["--warm", "--cold"])
def test_bench_loaders_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str) -> None:
    out = tmp_path / "rows.json"
    argv = ["--count", "3", "--size", "16", mode, "--region-size", "32", "--patch", "12", "--reps", "3",
            "--batch", "2", "--work", str(tmp_path / "work"), "--json", str(out)]  # fmt: skip
    assert bench_loaders.main(argv) == 0
    text = capsys.readouterr().out
    ceiling = "O_DIRECT" if mode == "--cold" else "np.fromfile"
    for name in (f"ceiling {ceiling}", "PreparedDataset[posix] items", "PreparedDataset[posix] batches",
                 "MONAI PersistentDataset", "whole volume 32^3", "region 12^3 of it"):  # fmt: skip
        assert name in text, text
    rows = [r for r in json.loads(out.read_text()) if "name" in r]
    assert all(r["seconds"] > 0 and r["nbytes"] > 0 for r in rows)
    ours = next(r for r in rows if r["name"] == "PreparedDataset[posix] batches")
    assert ours["items"] == 3 and ours["nbytes"] == 3 * 16**3 * (4 + 1)
    region = next(r for r in rows if r["name"].startswith("region"))
    assert region["nbytes"] == 3 * 12**3 * 4
    # the prepared cache is kept and reused by the next run with the same spec
    assert bench_loaders.main(argv) == 0


def test_bench_loaders_gpu_rows_say_why_without_gpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from loaders._deps import cuda_available

    if cuda_available():
        pytest.skip("a GPU is present: the GPU rows run instead")
    argv = ["--count", "2", "--size", "8", "--device", "cuda:0", "--no-region", "--work", str(tmp_path)]
    assert bench_loaders.main(argv) == 0
    assert "GPU rows: not run" in capsys.readouterr().out


def test_patch_larger_than_volume_is_refused(tmp_path: Path) -> None:
    assert bench_loaders.main(["--region-size", "8", "--patch", "9", "--work", str(tmp_path)]) == 2
