"""Layouts that pass every size and checksum check but are wrong: a key listed twice, a second name for one
shard (so two extents overlap unseen), a NUL in a shard name. Each is one FormatError line, also from
`prep verify` (exit 1, no traceback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from craft import copy_cache, edit_index, reseal
from typer.testing import CliRunner

from loaders import FormatError, PreparedCache, PreparedDataset
from prep.cli import app


def _refused(cache: Path, says: str) -> None:
    with pytest.raises(FormatError, match=says):
        PreparedDataset(cache)[0]
    result = CliRunner().invoke(app, ["verify", str(cache)])
    assert result.exit_code == 1, result.output
    assert says in result.output and "Traceback" not in result.output, result.output


def test_a_key_listed_twice_is_refused(good_cache: Path, tmp_path: Path) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")

    def twice(doc: dict[str, Any]) -> None:
        doc["keys"] = [doc["keys"][0]] * len(doc["keys"])

    reseal(cache, twice)
    _refused(cache, "is listed twice in 'keys'")


@pytest.mark.parametrize("alias", ["./{}", "shards/./{}", "shards//{}", "shards/../shards/{}"])
def test_a_second_name_for_one_shard_is_refused(good_cache: Path, tmp_path: Path, alias: str) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    first = _first_shard(cache)
    base = Path(first).name
    name = alias.format(first) if alias.startswith("./") else alias.format(base)

    def second(doc: dict[str, Any]) -> None:
        doc["shards"].append(name)

    def overlap(rows: np.ndarray) -> None:  # item 1's tensor claims item 0's bytes, through the other name
        rows["shard"][1] = 1
        rows["offset"][1] = rows["offset"][0]

    reseal(cache, second)
    edit_index(cache, overlap)
    _refused(cache, "names the same file as")


def test_a_nul_in_a_shard_name_is_one_line(good_cache: Path, tmp_path: Path) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    reseal(cache, lambda doc: doc["shards"].__setitem__(0, doc["shards"][0] + "\x00.bin"))
    _refused(cache, "holds a NUL")


def _first_shard(cache: Path) -> str:
    return str(PreparedCache(cache).manifest["shards"][0])
