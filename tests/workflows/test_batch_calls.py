"""workflows.bench.batch_calls: a made batch's CUDA calls and GPU work (GPU only; refused on the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workflows.bench import batch_calls


def test_batch_calls_refused_on_the_cpu_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert batch_calls.main(["--device", "cpu"]) == 2
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and "--device cuda:N" in out


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
    assert float(calls.split(": ")[1]) > 0 and float(work.split(": ")[1]) > 0
    assert any("Memcpy" in line or "kernel" in line for line in out)
    assert out[-1].startswith("the first ") and "cuda" in out[-1]
