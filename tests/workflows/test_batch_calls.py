"""workflows.bench.batch_calls: a made batch's CUDA calls and GPU work (GPU only; refused on the CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from workflows.bench import batch_calls


def test_batch_calls_refused_on_the_cpu_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert batch_calls.main(["--device", "cpu"]) == 2
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and "--device cuda:N" in out


def _event(cat: str, name: str, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": 0, "dur": 1, "args": args}


def test_tally_counts_a_traces_calls_and_gpu_work_by_name() -> None:
    # the shape of torch.profiler's chrome trace: ops, the CUDA calls they made, the GPU work those launched
    trace = {"traceEvents": [
        _event("cpu_op", "aten::cat", **{"External id": 7}),
        _event("cuda_runtime", "cudaLaunchKernel", correlation=1, **{"External id": 7}),
        _event("kernel", "CatArrayBatchedCopy", correlation=1, stream=7),
        _event("cuda_runtime", "cudaMemcpyAsync", correlation=2, **{"External id": 8}),
        _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", correlation=2, stream=7),
        _event("cuda_runtime", "cudaLaunchKernel", correlation=3),
        _event("kernel", "CatArrayBatchedCopy", correlation=3, stream=7),
    ]}  # fmt: skip
    got = batch_calls.tally(trace)
    assert got.calls == {"cudaLaunchKernel": 2, "cudaMemcpyAsync": 1}
    assert got.work == {"CatArrayBatchedCopy": 2, "Memcpy DtoD (Device -> Device)": 1}


def test_counting_counts_the_ops_on_tensors_of_the_kind_given_only() -> None:
    import torch

    a = torch.ones(4)
    with batch_calls.counting("cpu") as got:
        b = torch.cat([a, a]) * 2
        b.add_(1)
        torch.ones(2, device="meta") + 1  # not a cpu tensor: not counted
    assert b[0] == 3
    assert got.loose["cat"] == 1 and got.loose["mul"] == 1 and got.loose["add_"] == 1
    assert "add" not in got.loose and not got.captured and got.graphs == 0
    assert len(got.times) == 3  # cat, mul and add_ launch work


def test_counting_leaves_views_out_of_the_launches() -> None:
    import torch

    a = torch.ones(4, 4)
    with batch_calls.counting("cpu") as got:
        a[1:].reshape(-1)
        a.t()
    assert sum(got.loose.values()) >= 2 and got.times == []


def test_bursts_count_launches_apart_by_more_than_the_gap() -> None:
    assert batch_calls.bursts([]) == 0
    assert batch_calls.bursts([0.0, 0.0001, 0.0002]) == 1
    assert batch_calls.bursts([0.0, 0.0001, 0.004, 0.0041, 0.02]) == 3
    assert batch_calls.bursts([0.004, 0.0, 0.0041], gap=0.001) == 2  # in any order


@pytest.mark.gpu
def test_batch_calls_counts_a_made_batchs_calls_and_gpu_work(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    argv = ["--workload", "seg-aug", "--size", "40", "--crop", "16", "--count", "4", "--warm", "3", "--batches", "2",
            "--device", "cuda:0", "--work", str(tmp_path)]  # fmt: skip
    assert batch_calls.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    calls = next(line for line in out if line.startswith("runtime calls a batch, uncaptured: "))
    work = next(line for line in out if line.startswith("GPU work a batch, uncaptured: "))
    arrivals = next(line for line in out if line.startswith("arrivals a batch, as the child makes it: "))
    assert float(calls.split(": ")[1]) > 0 and float(work.split(": ")[1]) > 0
    graphs = float(arrivals.split("(graphs ")[1].split(",")[0])
    assert graphs >= 1  # seg-aug's batched transforms captured: a graph launched every batch
    in_time = next(line for line in out if line.startswith("arrivals in time a batch: "))
    assert 1 <= float(in_time.split(": ")[1].split()[0]) <= float(arrivals.split(": ")[1].split()[0])
    assert any("Memcpy" in line or "kernel" in line for line in out)
