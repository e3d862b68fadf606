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


def test_tally_splits_a_trace_into_graph_launched_and_loose_work_by_the_op() -> None:
    # the shape of torch.profiler's chrome trace: ops, the CUDA calls they made, the GPU work those launched
    trace = {"traceEvents": [
        _event("cpu_op", "aten::cat", **{"External id": 7}),
        _event("cuda_runtime", "cudaLaunchKernel", correlation=1, **{"External id": 7}),
        _event("kernel", "CatArrayBatchedCopy", correlation=1, stream=7),
        _event("cpu_op", "aten::copy_", **{"External id": 8}),
        _event("cuda_runtime", "cudaMemcpyAsync", correlation=2, **{"External id": 8}),
        _event("gpu_memcpy", "Memcpy DtoD (Device -> Device)", correlation=2, stream=7),
        _event("cuda_runtime", "cudaGraphLaunch", correlation=3),
        _event("kernel", "elementwise_kernel", correlation=3, stream=7),
        _event("kernel", "flip_kernel", correlation=3, stream=7),
        _event("kernel", "reduce_kernel", correlation=4, stream=7, **{"graph node id": 12}),  # launch not traced
        _event("kernel", "fill_kernel", correlation=5, stream=7),  # launched by no call the trace holds
    ]}  # fmt: skip
    got = batch_calls.tally(trace)
    assert got.calls == {"cudaLaunchKernel": 1, "cudaMemcpyAsync": 1, "cudaGraphLaunch": 1}
    assert got.graphs == 1 and got.in_graphs == 3
    assert got.loose == {"aten::cat: CatArrayBatchedCopy": 1, "aten::copy_: Memcpy DtoD (Device -> Device)": 1}
    assert got.unattributed == 1 and sum(got.work.values()) == 6


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
    calls = next(line for line in out if line.startswith("runtime calls a batch: "))
    work = next(line for line in out if line.startswith("GPU work a batch: "))
    arrivals = next(line for line in out if line.startswith("arrivals a batch: "))
    assert float(calls.split(": ")[1]) > 0 and float(work.split(": ")[1]) > 0
    assert float(arrivals.split(": ")[1].split()[0]) > 0  # graphs launched or work on its own, some each batch
    assert any("Memcpy" in line or "kernel" in line for line in out)
