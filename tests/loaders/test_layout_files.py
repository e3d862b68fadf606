"""Every layout file of a cache (manifest.json, index.npy, meta.jsonl, meta_offsets.npy) is opened as the shards
are: no link followed, no FIFO, checked in memory or again on every use (issue 48, findings 4, 5, 6, 8, 10)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import loaders.cache.format as fmt
from loaders.cache.format import PreparedCache
from loaders.cache.spec import INDEX, MANIFEST, MAX_MANIFEST, META, META_OFFSETS
from loaders.cache.writing import write_items
from loaders.errors import ChecksumError, FormatError, UnsafeFileError

LAYOUT = [MANIFEST, INDEX, META, META_OFFSETS]
# A reader and `prep verify` in a child with a timeout: a reader that blocks on a FIFO fails the test, never hangs it.
_CHILD = """
import sys
from typer.testing import CliRunner
from loaders.cache.format import PreparedCache
from prep.cli import app
try:
    PreparedCache(sys.argv[1])
    print("OPENED")
except Exception as exc:
    print("READER", type(exc).__name__, exc)
got = CliRunner().invoke(app, ["verify", sys.argv[1]])
print("VERIFY", got.exit_code, got.output.strip().splitlines()[-1] if got.output.strip() else "")
"""


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    rng = np.random.default_rng(0)
    items: list[Mapping[str, Any]] = [{"image": rng.random((1, 4, 5, 6), dtype=np.float32)} for _ in range(3)]
    meta = [{"source": {"image": f"/data/{i}.nii"}, "meta": {}} for i in range(3)]
    return write_items(tmp_path / "c", items, meta).root


def _reader_and_verify(root: Path) -> tuple[str, str]:
    out = subprocess.run([sys.executable, "-c", _CHILD, str(root)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})  # fmt: skip
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    return lines[0], lines[1]


@pytest.mark.parametrize("name", LAYOUT)
def test_a_fifo_in_place_of_a_layout_file_is_refused_by_reader_and_verify(cache: Path, name: str) -> None:
    (cache / name).unlink()
    os.mkfifo(cache / name)
    reader, verify = _reader_and_verify(cache)
    assert reader.startswith("READER UnsafeFileError") and f"{cache / name}: is a FIFO" in reader, reader
    assert verify.startswith("VERIFY 1") and f"{name}: is a FIFO" in verify, verify


@pytest.mark.parametrize("name", LAYOUT)
def test_a_symlink_to_an_identical_outside_file_is_refused(cache: Path, tmp_path: Path, name: str) -> None:
    """No checksum oracle: the outside copy matches every checksum, and is still refused."""
    outside = tmp_path / f"outside-{name}"
    shutil.copyfile(cache / name, outside)
    (cache / name).unlink()
    (cache / name).symlink_to(outside)
    with pytest.raises(UnsafeFileError, match=f"{cache / name}: is a symlink.*links are never followed"):
        PreparedCache(cache)
    reader, verify = _reader_and_verify(cache)
    assert verify.startswith("VERIFY 1") and "is a symlink" in verify, verify


def test_the_index_is_in_memory_read_only_and_blind_to_later_edits(cache: Path) -> None:
    reader = PreparedCache(cache)
    assert not isinstance(reader.index, np.memmap) and not reader.index.flags.writeable
    before = reader.entries(0)
    rows = np.load(cache / INDEX)
    rows[[0, 1]] = rows[[1, 0]]  # item 1's image listed as item 0's, in place
    with open(cache / INDEX, "r+b") as f:  # the same inode, as an in-place edit
        np.lib.format.write_array(f, rows)
    assert reader.entries(0) == before
    os.truncate(cache / INDEX, 10)  # truncated under the reader: no SIGBUS, the checked copy is served
    assert reader.entries(0) == before
    with pytest.raises(ChecksumError, match=f"{cache / INDEX}: 10 bytes, the manifest says"):
        PreparedCache(cache)


def test_a_large_meta_is_checked_again_on_every_read(
    cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fmt, "SMALL", 0)  # meta.jsonl not held in memory: read per use
    reader = PreparedCache(cache)
    assert reader.meta(0)["source"]["image"] == "/data/0.nii"
    text = (cache / META).read_bytes()
    renamed = tmp_path / "renamed"
    renamed.write_bytes(text.replace(b"/data/0.nii", b"/data/9.nii"))  # same size, other content
    os.replace(renamed, cache / META)
    with pytest.raises(ChecksumError, match=f"{cache / META}: bytes 0-.* fail their checksum"):
        reader.meta(0)
    (tmp_path / "secret").write_bytes(text)  # the right bytes, outside, behind a link
    (cache / META).unlink()
    (cache / META).symlink_to(tmp_path / "secret")
    with pytest.raises(UnsafeFileError, match=f"{cache / META}: is a symlink"):
        reader.meta(0)
    (cache / META).unlink()
    (cache / META).write_bytes(text[:10])  # truncated under the reader
    with pytest.raises(ChecksumError, match=f"{cache / META}: 10 bytes, the manifest says"):
        reader.meta(0)


def test_a_two_dimensional_index_is_one_line(cache: Path) -> None:
    from tests.security.craft import reseal

    rows = np.load(cache / INDEX)
    np.save(cache / INDEX, np.stack([rows, rows]))
    reseal(cache)
    with pytest.raises(FormatError, match=f"{cache / INDEX}: rows are a 2-D .* not the index's 1-D row layout"):
        PreparedCache(cache)
    reader, verify = _reader_and_verify(cache)
    assert verify.startswith("VERIFY 1") and "2-D" in verify, verify


def test_the_manifest_size_is_bounded(cache: Path) -> None:
    doc = json.loads((cache / MANIFEST).read_text())
    with open(cache / MANIFEST, "a") as f:
        f.truncate(MAX_MANIFEST + 1)  # sparse padding after the document: nothing read before the bound
    with pytest.raises(UnsafeFileError, match=f"{cache / MANIFEST}: {MAX_MANIFEST + 1} bytes, over the"):
        PreparedCache(cache)
    assert doc["format"] == "blockprep-cache"
