"""workflows.bench.interference, tiny and on the CPU: every row the CPU has, each with its step time."""

from __future__ import annotations

from pathlib import Path

import pytest

from workflows.bench import interference


def test_prints_a_row_per_kind_of_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "mednist", "--count", "8", "--size", "32", "--steps", "2", "--device", "cpu",
            "--work", str(tmp_path)]  # fmt: skip
    assert interference.main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["none", "python", "numpy"]
    assert all(float(r[1]) > 0 for r in rows) and float(rows[1][3]) > 0  # the Python thread looped


def test_the_hand_over_gap_is_in_every_row(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "mednist", "--count", "8", "--size", "32", "--steps", "2", "--device", "cpu",
            "--work", str(tmp_path), "--kinds", "none,numpy", "--handover-ms", "30"]  # fmt: skip
    assert interference.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert "30.0 ms of host work at each step's start" in out[0]
    rows = [line.split() for line in out[2:]]
    assert [r[0] for r in rows] == ["none", "numpy"] and all(float(r[1]) >= 30.0 for r in rows)


def test_a_busy_process_beside_the_step_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "mednist", "--count", "8", "--size", "32", "--steps", "2", "--device", "cpu",
            "--work", str(tmp_path), "--processes", "--kinds", "none,process-busy"]  # fmt: skip
    assert interference.main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [r[0] for r in rows] == ["none", "process-busy"] and all(float(r[1]) > 0 for r in rows)
