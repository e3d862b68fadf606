"""Fixtures of the workflow tests: a real one-node SLURM cluster on localhost (session-wide)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from slurmcluster import SlurmCluster, slurm_cluster, unavailable_reason


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """munged + slurmctld + slurmd on this machine; skips with the reason when not root or not installed."""
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster
