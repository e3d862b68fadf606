"""workflows.bench.timeline: per-step means from a chrome trace (a made-up one), and the tool end to end on the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from workflows.bench import profile_train
from workflows.bench.timeline import STEP, step_times


def _kernel(stream: int, ts: float, dur: float) -> dict[str, object]:
    return {"cat": "kernel", "name": "k", "ts": ts, "dur": dur, "args": {"stream": stream}}


def test_step_times_split_each_step_by_stream() -> None:
    """Two steps of 10 ms (1 ms apart); the training stream (7, the most kernel time) runs 2-6 and 7-9 ms into the
    first, 1-9 into the second; the loader's stream (20) 5-8 ms into the first, overlapping the training's."""
    events = [
        {"name": STEP, "cat": "user_annotation", "ts": 0, "dur": 10_000},
        {"name": STEP, "cat": "user_annotation", "ts": 11_000, "dur": 10_000},
        {"name": STEP, "cat": "gpu_user_annotation", "ts": 2_000, "dur": 7_000},  # the same step on the GPU
        _kernel(7, 2_000, 4_000),
        _kernel(7, 7_000, 2_000),
        _kernel(20, 5_000, 3_000),
        _kernel(7, 12_000, 8_000),
    ]
    t = step_times({"traceEvents": events})
    assert t is not None and t.steps == 2
    assert t.window == pytest.approx(10.0) and t.between == pytest.approx(1.0)
    assert t.training_kernels == pytest.approx((6 + 8) / 2)
    assert t.training_span == pytest.approx((7 + 8) / 2)
    assert t.launch_gap == pytest.approx((2 + 1) / 2)
    assert t.other_kernels == pytest.approx(3 / 2)
    assert t.idle == pytest.approx(((10 - 7) + (10 - 8)) / 2)  # step 1: busy 2-9 ms of its 10


def test_no_kernels_or_no_steps_give_none() -> None:
    assert step_times({"traceEvents": [{"name": STEP, "cat": "user_annotation", "ts": 0, "dur": 5}]}) is None
    assert step_times({"traceEvents": [_kernel(7, 0, 5)]}) is None


@pytest.mark.parametrize("feeder", [[], ["--feeder", "True"]])
def test_timeline_runs_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str], feeder: list[str]) -> None:
    argv = ["--workload", "mednist", "--count", "8", "--size", "32", "--steps", "3", "--device", "cpu",
            "--work", str(tmp_path), "--timeline", *feeder]  # fmt: skip
    assert profile_train.main(argv) == 0
    out = capsys.readouterr().out
    assert f"feeder={bool(feeder)}" in out and ("made by process" in out) == bool(feeder)
    assert "with the loader: no CUDA kernels traced" in out and "compute only: no CUDA kernels traced" in out
