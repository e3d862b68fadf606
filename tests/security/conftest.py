"""A good cache to craft bad ones from (each test edits its own copy)."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def good_cache(tmp_path_factory: pytest.TempPathFactory, nifti_dataset: Path) -> Path:
    """The demo pipeline's cache of the six-volume NIfTI fixture."""
    from prep.cache import prepare_cache

    spheres = Path(__file__).parents[2] / "workflows" / "pipelines" / "spheres.py"
    out = tmp_path_factory.mktemp("good") / "cache"
    prepare_cache(nifti_dataset, spheres, out, workers=1)
    return out
