"""Fixtures of the loader tests: a cache prepared from part of a grown datalist (`grownutil.make_grown`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="module")
def grown(nifti_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A cache prepared from the first 4 entries; the datalist those 4, 2 more, and one changed entry."""
    pytest.importorskip("monai")
    from grownutil import make_grown

    return make_grown(nifti_dataset, tmp_path_factory.mktemp("grown"))


@pytest.fixture
def fresh(grown: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """`grown` with a cache of this test's own: the drop-in writes the items it computes into it."""
    from grownutil import fresh_copy

    return fresh_copy(grown, tmp_path)
