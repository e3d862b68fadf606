"""Stress: the default threaded `prep cache` head, started many times in fresh processes, never hangs.

torch 2.3's first numpy->tensor conversion in a process initialises numpy support inside a C++ function-local
static while holding the GIL, and that initialiser imports a Python module (which lets go of the GIL): a second
thread converting at the same moment waits on the static's guard while holding the GIL, and both stop for good.
Only the first conversion of a process can hang, so each run is a fresh `python -m prep cache` process.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
from cacheutil import REPO, SPHERES

from prep import worker

RUNS = 20
# a run takes seconds (most of it importing torch; a minute on a busy 2-core box); a hung one never ends
RUN_TIMEOUT_S = 180


@pytest.fixture(scope="module")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four 8^3 pairs: the two worker threads start their first items at the same moment."""
    from prep.synth import nifti_dataset

    return nifti_dataset(tmp_path_factory.mktemp("tiny") / "spheres", count=4, size=8, seed=1)


@pytest.mark.slow
def test_threaded_prep_cache_never_hangs(tmp_path: Path, tiny_dataset: Path) -> None:
    failed = []
    for run in range(RUNS):
        out = tmp_path / f"cache{run}"
        cmd = [sys.executable, "-m", "prep", "cache", str(tiny_dataset), "--pipeline", str(SPHERES),
               "--output", str(out), "--workers", "2"]  # fmt: skip
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S, cwd=REPO)
        except subprocess.TimeoutExpired:  # no point waiting for the rest: one hang is the failure
            pytest.fail(f"run {run + 1} of {RUNS} hung (no exit in {RUN_TIMEOUT_S} s): {' '.join(cmd)}")
        if proc.returncode != 0:
            failed.append((run, proc.stdout[-2000:] + proc.stderr[-2000:]))
    assert not failed, f"{len(failed)} of {RUNS} runs failed: {failed}"


def test_warm_torch_is_idempotent_and_thread_safe() -> None:
    """warm_torch from many threads at once: every call returns, numpy interop works afterwards."""
    import numpy as np
    import torch

    errors: list[BaseException] = []

    def call() -> None:
        try:
            worker.warm_torch()
        except BaseException as exc:  # handed to the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=call) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in threads)
    assert torch.as_tensor(np.arange(3)).tolist() == [0, 1, 2]
