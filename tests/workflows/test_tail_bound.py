"""workflows.bench.tail_bound: the step beside the chain's own tail as CUDA graphs (GPU only; refused on the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from workflows.bench import tail_bound


def test_refused_on_the_cpu_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert tail_bound.main(["--device", "cpu"]) == 2
    out = capsys.readouterr().out.strip()
    assert out.count("\n") == 0 and "--device cuda:N" in out


@pytest.mark.gpu
@pytest.mark.parametrize("workload", ["seg-aug", "seg-elastic"])
def test_a_row_per_way_with_the_tails_graphs(workload: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    argv = ["--workload", workload, "--size", "40", "--crop", "16", "--count", "4", "--steps", "4", "--batches", "3",
            "--device", "cuda:0", "--work", str(tmp_path)]  # fmt: skip
    assert tail_bound.main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert "3 batches captured" in out[0]
    rows = [[line[:28].strip(), *line[28:].split()] for line in out[2:-1]]
    assert [r[0] for r in rows] == ["alone, first", "tail graphs, this process", "tail graphs, 2nd process",
                                    "batches made, 2nd process", "made, uncaptured, 2nd", "alone, last"]  # fmt: skip
    assert all(float(r[1]) > 0 for r in rows) and out[-1].startswith("a batch's graphs alone, synced: ")
    # the second process made (or replayed) batches beside the steps (at most one a step: a step's go while it
    # is still making one is not counted twice), and said so
    assert all(1 <= int(r[4]) <= 4 and r[5] == "batches;" for r in rows if "2nd" in r[0])
    assert all(len(r) == 4 for r in rows if "2nd" not in r[0])
