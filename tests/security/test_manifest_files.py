"""The manifest's `files` record is untrusted: a name outside the layout is never opened (no hashing oracle),
and a chunk size is bounded before a reader allocates on it; each refusal is one FormatError line, also
from `prep verify`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from craft import copy_cache
from typer.testing import CliRunner

from loaders import FormatError, PreparedDataset
from loaders.cache.checksums import doc_checksum, file_record
from loaders.cache.spec import INDEX, MANIFEST
from prep.cli import app


def _edit_files(root: Path, edit: Any) -> None:
    """Edit the manifest's `files` (edit(files)), then recompute the manifest's own checksum."""
    path = root / MANIFEST
    doc = json.loads(path.read_text())
    edit(doc["files"])
    doc["checksum"] = doc_checksum(doc)
    path.write_text(json.dumps(doc))


def _refused(cache: Path, says: str) -> None:
    with pytest.raises(FormatError, match=says):
        PreparedDataset(cache)
    result = CliRunner().invoke(app, ["verify", str(cache)])
    assert result.exit_code == 1, result.output
    assert says in result.output and "Traceback" not in result.output, result.output


@pytest.mark.parametrize("name", ["../../secret.txt", "/etc/hostname", "shards/x.bin"])
def test_a_file_record_outside_the_layout_is_never_opened(good_cache: Path, tmp_path: Path, name: str) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    secret = tmp_path / "secret.txt"
    secret.write_text("guess me")
    _edit_files(cache, lambda files: files.update({name: file_record(secret)}))
    _refused(cache, "not a file of the layout")


@pytest.mark.parametrize("chunk", [2**40, 0, math.nan, "1048576", [1 << 20], True, 512])
def test_a_file_record_chunk_is_bounded(good_cache: Path, tmp_path: Path, chunk: Any) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    _edit_files(cache, lambda files: files[INDEX].update(chunk=chunk))
    _refused(cache, "has chunk")


@pytest.mark.parametrize(
    ("field", "value"), [("size", -1), ("size", "12"), ("xxh3", "00"), ("xxh3", ["zz" * 8]), ("xxh3", None)]
)
def test_a_file_record_size_and_digests_are_checked(good_cache: Path, tmp_path: Path, field: str, value: Any) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    _edit_files(cache, lambda files: files[INDEX].update({field: value}))
    _refused(cache, "the manifest's record of this file")
