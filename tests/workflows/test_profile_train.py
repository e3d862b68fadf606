"""Smoke test of workflows.bench.profile_train (the profiler's table, and the loader alone), tiny and on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from workflows.bench import profile_train


@pytest.mark.parametrize("loader_only", [False, True])
def test_profile_train_prints_its_table(tmp_path: Path, capsys: pytest.CaptureFixture[str], loader_only: bool) -> None:
    """mednist: a class label on the CPU reaches the model's loss on the model's device."""
    argv = ["--workload", "mednist", "--count", "8", "--size", "32", "--steps", "3", "--device", "cpu",
            "--work", str(tmp_path), "--rows", "5"] + (["--loader-only"] if loader_only else [])  # fmt: skip
    assert profile_train.main(argv) == 0
    out = capsys.readouterr().out
    assert ("batches/s" in out) if loader_only else ("mednist: 3 steps" in out and "Self CPU" in out)


def test_first_batch_names_where_the_time_went(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--first-batch: per feeder setting the build and first-batch seconds, and the threads' sampled frames (a
    tiny cache's first batch may come before any sample: only the tables' heads are certain)."""
    argv = ["--workload", "mednist", "--count", "8", "--size", "32", "--device", "cpu", "--work", str(tmp_path),
            "--rows", "40", "--first-batch", "--feeder", "False"]  # fmt: skip
    assert profile_train.main(argv) == 0
    out = capsys.readouterr().out
    assert out.count("built in") == 1 and "feeder=False" in out and "first batch" in out
    assert "inclusive s | thread | frame" in out and "leaf s | thread | line" in out


def test_ops_count_the_tails_work_by_transform(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--ops: seg-aug's tail, transform by transform, with the ops each ran a batch (no device kernels on the CPU)."""
    argv = ["--workload", "seg-aug", "--size", "40", "--crop", "16", "--count", "4", "--steps", "4", "--device",
            "cpu", "--work", str(tmp_path), "--rows", "3", "--loader-only", "--ops"]  # fmt: skip
    assert profile_train.main(argv) == 0
    out = capsys.readouterr().out
    table = out[out.index("the tail a batch, by transform") :].splitlines()
    rows = {line.split()[0]: line.split()[1:] for line in table[2:] if line.strip()}
    assert {"RandAffined", "RandGaussianSharpend", "RandFlipd", "all"} <= set(rows)
    assert float(rows["RandAffined"][0]) > 0 and float(rows["all"][1]) == 0.0
