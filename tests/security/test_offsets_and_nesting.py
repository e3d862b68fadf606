"""meta_offsets.npy, the manifest's nesting, index shapes and meta line lengths are bounded: each crafted
value (checksums recomputed) is one FormatError line in every reader and in `prep verify` (exit 1)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from craft import copy_cache, edit_index, reseal
from typer.testing import CliRunner

from loaders import FormatError, PreparedCache, PreparedDataset
from loaders.cache.spec import MANIFEST, META_OFFSETS
from loaders.cache.writing import write_meta
from prep.cli import app


def _readers(cache: Path) -> list[Callable[[], object]]:
    return [lambda: PreparedCache(cache).meta(0), lambda: PreparedDataset(cache)[0]]


def _refused(cache: Path, says: str) -> None:
    for read in _readers(cache):
        with pytest.raises(FormatError, match=says):
            read()
    result = CliRunner().invoke(app, ["verify", str(cache)])
    assert result.exit_code == 1, result.output
    assert says in result.output and "Traceback" not in result.output, result.output


def _offsets(cache: Path, save: Callable[[Path, np.ndarray], None]) -> None:
    good = np.load(cache / META_OFFSETS).astype(np.int64)
    save(cache / META_OFFSETS, good)
    reseal(cache)


def _pickled(path: Path, good: np.ndarray) -> None:
    np.save(path, np.array(list(good), dtype=object), allow_pickle=True)


def _two_d(path: Path, good: np.ndarray) -> None:
    np.save(path, np.stack([good, good], axis=1))


def _negative(path: Path, good: np.ndarray) -> None:
    np.save(path, np.concatenate([[-5], good[1:]]))


def _decreasing(path: Path, good: np.ndarray) -> None:
    np.save(path, good[::-1].copy())


def _huge(path: Path, good: np.ndarray) -> None:
    np.save(path, np.concatenate([good[:-1], [2**62]]).astype(np.uint64))


def _header(path: Path, good: np.ndarray) -> None:
    np.save(path, good)
    raw = path.read_bytes().replace(f"({len(good)},)".encode(), b"(99999999999,)")
    path.write_bytes(raw)


@pytest.mark.parametrize(
    ("save", "says"),
    [
        (_pickled, "not an array of offsets"),
        (_two_d, "not 1-D integers"),
        (_negative, "negative or decreasing"),
        (_decreasing, "negative or decreasing"),
        (_huge, "past the end of meta.jsonl"),
        (_header, "not an array of offsets"),
    ],
    ids=["pickled", "2-D", "negative", "decreasing", "huge", "absurd-header"],
)
def test_bad_meta_offsets_are_refused(good_cache: Path, tmp_path: Path, save, says: str) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    _offsets(cache, save)
    _refused(cache, says)


def test_a_manifest_nested_100000_deep_is_one_line(good_cache: Path, tmp_path: Path) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    text = (cache / MANIFEST).read_text()
    (cache / MANIFEST).write_text(text.rstrip()[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    _refused(cache, "nested too deeply")


def test_a_shape_of_2_to_the_64_is_refused(good_cache: Path, tmp_path: Path) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")

    def edit(rows: np.ndarray) -> None:
        rows["ndim"][0] = 2
        rows["shape"][0, :2] = [0, 2**64 - 1]  # zero elements: the byte count alone cannot refuse it
        rows["shape"][0, 2:] = 0
        rows["nbytes"][0] = 0

    edit_index(cache, edit)
    with pytest.raises(FormatError, match="size of 2"):
        PreparedDataset(cache)[0]
    result = CliRunner().invoke(app, ["verify", str(cache)])
    assert result.exit_code == 1 and "size of 2" in result.output, result.output


def test_meta_lines_are_bounded_at_write_and_read(good_cache: Path, tmp_path: Path) -> None:
    big = {"source": "x.nii.gz", "meta": {"blob": "a" * (17 << 20)}}
    with pytest.raises(FormatError, match="over the 16 MiB limit"):
        write_meta(tmp_path / "w", [big])
    cache = copy_cache(good_cache, tmp_path / "c")
    lines = (cache / "meta.jsonl").read_bytes().splitlines(keepends=True)
    lines[0] = json.dumps(big).encode() + b"\n"
    (cache / "meta.jsonl").write_bytes(b"".join(lines))
    np.save(cache / META_OFFSETS, np.cumsum([0] + [len(x) for x in lines[:-1]]).astype(np.uint64))
    reseal(cache)
    _refused(cache, "over the 16 MiB limit")
