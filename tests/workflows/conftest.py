"""Fixtures of the workflow tests: a real one-node SLURM cluster on localhost (session-wide), a cache whose
epochs are long enough to stop a training mid-epoch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from cacheutil import SPHERES
from slurmcluster import SlurmCluster, slurm_cluster, unavailable_reason


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """munged + slurmctld + slurmd on this machine; skips with the reason when not root or not installed."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def epoch_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """24 prepared 48^3 spheres (the demo pipeline's 32^3 crops fit after resampling): with batch 1 an epoch is
    24 steps, so a run stopped after a few steps stops mid-epoch."""
    from prep.cache import prepare_cache
    from prep.synth import nifti_dataset

    root = tmp_path_factory.mktemp("epoch")
    datalist = nifti_dataset(root / "nifti", count=24, size=48, seed=3)
    prepare_cache(datalist, SPHERES, root / "cache", workers=2, processes=False)
    return root / "cache"
