"""Descriptors close with their dataset (issue 48, finding 9): 1,000 `PreparedDataset`s opened, read and dropped
leave no shard descriptor behind (the default `ulimit -n` is 1,024)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np

from loaders.cache.writing import write_items


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_thousand_dropped_datasets_keep_no_descriptor(tmp_path: Path) -> None:
    from loaders import PreparedDataset

    root = write_items(tmp_path / "c", [{"image": np.ones((1, 4, 5, 6), np.float32)}] * 2).root
    PreparedDataset(root)[0]  # whatever the first use loads for good (modules, probes) is loaded before counting
    gc.collect()
    before = _fds()
    for _ in range(1000):
        ds = PreparedDataset(root)
        ds[0], ds[1]
        del ds
    gc.collect()  # a dataset caught in a reference cycle is freed by the collector, its descriptors with it
    assert _fds() <= before + 2, f"{_fds() - before} descriptors left open by 1,000 dropped datasets"
