"""prep verify: every kind of damage to a committed cache is reported, item by item."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from loaders.format import INDEX, PreparedCache, write_items
from prep.cli import app
from prep.errors import PrepError
from prep.verify import verify_cache


@pytest.fixture
def cache(tmp_path: Path) -> PreparedCache:
    rng = np.random.default_rng(0)
    items: list[Mapping[str, Any]] = [
        {
            "image": rng.random((1, 9, 10, 11), dtype=np.float32),
            "label": (rng.random((1, 9, 10, 11)) > 0.5).astype("u1"),
        }
        for _ in range(4)
    ]
    return write_items(tmp_path / "c", items)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def test_clean_cache_verifies(cache: PreparedCache) -> None:
    assert verify_cache(cache.root) == []
    result = CliRunner().invoke(app, ["verify", str(cache.root)])
    assert result.exit_code == 0, result.output
    assert "every tensor verified" in result.output


def test_every_flipped_tensor_reported(cache: PreparedCache) -> None:
    victims = [cache.entries(1)[0], cache.entries(3)[1]]
    for e in victims:
        _flip(e.shard, e.offset + e.nbytes - 1)
    bad = verify_cache(cache.root)
    assert [(b.item, b.key) for b in bad] == [(1, "image"), (3, "label")]
    assert all("checksum mismatch" in b.reason for b in bad)
    result = CliRunner().invoke(app, ["verify", str(cache.root)])
    assert result.exit_code == 1 and "2 bad tensors" in result.output


def test_padding_damage_is_not_a_tensor_error(cache: PreparedCache) -> None:
    e = cache.entries(0)[0]
    _flip(e.shard, e.offset + e.nbytes + 1)  # in the alignment padding: no tensor byte changed
    assert verify_cache(cache.root) == []


def test_truncated_shard_reported(cache: PreparedCache) -> None:
    last = cache.entries(3)[1]
    os.truncate(last.shard, last.offset + 10)
    bad = verify_cache(cache.root)
    assert any(b.item == 3 and b.key == "label" and "shard ends" in b.reason for b in bad)
    assert any("index says" in b.reason for b in bad)


def test_index_shape_mismatch_and_missing_shard(cache: PreparedCache) -> None:
    index = np.load(cache.root / INDEX)
    index[2]["shape"][1] = 99
    np.save(cache.root / INDEX, index)
    bad = verify_cache(cache.root)
    assert [(b.item, "needs" in b.reason) for b in bad] == [(1, True)]
    os.unlink(cache.shards[0])
    assert len(verify_cache(cache.root)) == 8 + 1  # every tensor, plus the shard itself


def test_uncommitted_cache_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    with pytest.raises(PrepError, match="incomplete"):
        verify_cache(tmp_path / "c")
    result = CliRunner().invoke(app, ["verify", str(tmp_path / "c")])
    assert result.exit_code == 1 and "error:" in result.output
