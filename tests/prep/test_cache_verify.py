"""prep verify: every kind of damage to a committed cache is reported, item by item."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from loaders.cache.format import PreparedCache
from loaders.cache.spec import BMAP, INDEX, MANIFEST, META, META_OFFSETS
from loaders.cache.writing import write_items
from loaders.errors import ChecksumError
from prep.cache_verify import verify_cache
from prep.cli import app
from prep.errors import PrepError


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
    assert "every tensor verified (8 tensors in 1 shard(s))" in result.output
    assert "manifest.json, index.npy, meta.jsonl, meta_offsets.npy match their checksums" in result.output


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


def test_missing_shard(cache: PreparedCache) -> None:
    os.unlink(cache.shards[0])
    assert len(verify_cache(cache.root)) == 8 + 1  # every tensor, plus the shard itself


def test_not_a_cache_says_what_it_is(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    with pytest.raises(PrepError, match="not a prepared cache"):
        verify_cache(tmp_path / "c")
    (tmp_path / "c" / "journal").mkdir()
    with pytest.raises(PrepError, match="incomplete"):
        verify_cache(tmp_path / "c")
    (tmp_path / "f").write_text("x")
    result = CliRunner().invoke(app, ["verify", str(tmp_path / "f")])
    assert result.exit_code == 1 and "is a file, not a cache directory" in result.output
    result = CliRunner().invoke(app, ["verify", str(tmp_path / "c")])
    assert result.exit_code == 1 and "error:" in result.output


@pytest.fixture
def with_meta(tmp_path: Path) -> Path:
    """A cache with affines in meta.jsonl (as `prep cache` writes them)."""
    rng = np.random.default_rng(1)
    items: list[Mapping[str, Any]] = [{"image": rng.random((1, 4, 5, 6), dtype=np.float32)} for _ in range(3)]
    metas = [{"meta": {"image": {"affine": np.diag([1.5 + i, 2.0, 3.0, 1.0]).tolist()}}} for i in range(3)]
    return write_items(tmp_path / "m", items, metas).root


def _refused_on_open_and_by_verify(root: Path, match: str) -> None:
    with pytest.raises(PrepError, match=match):
        PreparedCache(root)
    with pytest.raises(PrepError, match=match):
        verify_cache(root)
    result = CliRunner().invoke(app, ["verify", str(root)])
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: ") and len(result.output.strip().splitlines()) == 1, result.output


def test_one_digit_in_meta_refused(with_meta: Path) -> None:
    text = (with_meta / META).read_text()
    assert '"affine":[[2.5,' in text
    (with_meta / META).write_text(text.replace('"affine":[[2.5,', '"affine":[[2.6,'))  # same size
    _refused_on_open_and_by_verify(with_meta, "meta.jsonl: bytes 0-.* fail their checksum")


def test_index_shape_edited_same_size_refused(cache: PreparedCache) -> None:
    size = (cache.root / INDEX).stat().st_size
    index = np.load(cache.root / INDEX)
    index[2]["shape"][1], index[2]["shape"][2] = index[2]["shape"][2], index[2]["shape"][1]  # same nbytes
    np.save(cache.root / INDEX, index)
    assert (cache.root / INDEX).stat().st_size == size
    _refused_on_open_and_by_verify(cache.root, "index.npy: bytes .* fail their checksum")


def test_deleted_meta_offsets_refused(cache: PreparedCache) -> None:
    (cache.root / META_OFFSETS).unlink()
    _refused_on_open_and_by_verify(cache.root, "meta_offsets.npy: missing from the cache")


def test_edited_manifest_refused(cache: PreparedCache) -> None:
    manifest = json.loads((cache.root / MANIFEST).read_text())
    (cache.root / MANIFEST).write_text(json.dumps({**manifest, "n_items": 3}))
    _refused_on_open_and_by_verify(cache.root, "manifest.json: fails its checksum")
    (cache.root / MANIFEST).write_text(json.dumps(manifest))
    assert verify_cache(cache.root) == []
    (cache.root / BMAP).write_text('{"files": {}}')  # remade per copy of the cache: its own checksum covers it
    assert "bmap.json" not in PreparedCache(cache.root).files


def test_schema_1_cache_refused_with_the_fix(cache: PreparedCache) -> None:
    manifest = json.loads((cache.root / MANIFEST).read_text())
    old = {k: v for k, v in manifest.items() if k not in ("files", "checksum")}
    (cache.root / MANIFEST).write_text(json.dumps({**old, "schema_version": "1.0"}))
    _refused_on_open_and_by_verify(cache.root, r"schema version 1.0 .* re-run `prep cache --force`")


def test_large_files_checked_as_read(with_meta: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above SMALL bytes a file is not read whole on open: each part is checked before it is used."""
    import loaders.cache.checksums
    import loaders.cache.format as fmt

    monkeypatch.setattr(loaders.cache.checksums, "CHUNK", 64)  # several chunks even in this small cache
    monkeypatch.setattr(loaders.cache.checksums, "MIN_CHUNK", 64)  # below the bound a crafted record may not go
    meta = [PreparedCache(with_meta).meta(i) for i in range(3)]
    write_items(with_meta, [{"image": np.zeros((1, 4, 5, 6), np.float32)}] * 3, meta)
    monkeypatch.setattr(fmt, "SMALL", 0)
    text = (with_meta / META).read_text()
    (with_meta / META).write_text(text.replace('"affine":[[3.5,', '"affine":[[3.6,'))
    cache = PreparedCache(with_meta)  # opens: nothing checked whole
    assert cache.meta(0)["meta"]["image"]["affine"][0][0] == 1.5
    with pytest.raises(ChecksumError, match="meta.jsonl"):
        cache.meta(2)
    assert len(cache.entries(1)) == 1
    with pytest.raises(ChecksumError):
        verify_cache(with_meta)
