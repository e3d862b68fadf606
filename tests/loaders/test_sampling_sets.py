"""Sampling sets (issue 48, findings 5, 6, 7, 8): checked by `prep verify` against the cached label they were made
from (foreground and background swapped and resealed fail it), opened as every layout file is (no link, no FIFO),
and read and checked again on every use (a bits.bin truncated under a reader is an error, never SIGBUS)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_folds import CHAINS, _volumes
from typer.testing import CliRunner

from loaders.cache import sampling
from loaders.cache.checksums import doc_checksum, file_record
from loaders.cache.format import PreparedCache
from loaders.errors import ChecksumError, UnsafeFileError
from prep.cache_verify import verify_cache
from prep.cli import app


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from prep.cache import prepare_cache

    root = tmp_path_factory.mktemp("sets")
    pipeline = root / "pipeline.py"
    pipeline.write_text(CHAINS["posneg-3d"][2])
    prepare_cache(_volumes(root / "data", 3, "uint8", n=3), pipeline, root / "cache", workers=1)
    return root / "cache"


@pytest.fixture
def cache(made: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(made, tmp_path / "cache"))


def _where(cache: Path) -> Path:
    (sig,) = sampling.stored_signatures(cache)
    return sampling.folder(cache, sig)


def _store(cache: Path) -> sampling.SetStore:
    (sig,) = sampling.stored_signatures(cache)
    return sampling.SetStore(cache, sig, PreparedCache(cache).generation)


def test_swapped_foreground_and_background_fail_verify(cache: Path) -> None:
    assert verify_cache(cache) == []
    where = _where(cache)
    rows = np.load(where / sampling.SETS)
    bits = bytearray((where / sampling.BITS).read_bytes())
    for fg, bg in zip(rows[0::2], rows[1::2]):  # set 0 (foreground) and set 1 (background) of every item swapped
        a, b, n = int(fg["offset"]), int(bg["offset"]), int(bg["offset"] - fg["offset"])
        bits[a : a + n], bits[b : b + n] = bits[b : b + n], bits[a : a + n]
    rows["count"][0::2], rows["count"][1::2] = rows["count"][1::2].copy(), rows["count"][0::2].copy()
    (where / sampling.BITS).write_bytes(bits)
    np.save(where / sampling.SETS, rows)
    doc = json.loads((where / sampling.MANIFEST).read_text())
    doc["files"] = {name: file_record(where / name) for name in (sampling.SETS, sampling.BITS)}
    doc["checksum"] = doc_checksum(doc)  # resealed: every checksum matches
    (where / sampling.MANIFEST).write_text(json.dumps(doc))
    bad = verify_cache(cache)
    assert [b.item for b in bad] == [0, 1, 2] and all("sampling sets differ" in b.reason for b in bad)
    result = CliRunner().invoke(app, ["verify", str(cache)])
    assert result.exit_code == 1 and "sampling sets differ" in result.output, result.output


@pytest.mark.parametrize("name", [sampling.SETS, sampling.BITS, sampling.MANIFEST])
def test_a_set_file_as_a_link_or_a_fifo_is_refused(cache: Path, tmp_path: Path, name: str) -> None:
    where = _where(cache)
    shutil.copyfile(where / name, tmp_path / "copy")  # identical bytes: only the link gives it away
    (where / name).unlink()
    (where / name).symlink_to(tmp_path / "copy")
    with pytest.raises(UnsafeFileError, match=f"{where / name}: is a symlink"):
        _store(cache) if name != sampling.MANIFEST else sampling.stored_signatures(cache)
    (where / name).unlink()
    os.mkfifo(where / name)
    keep = os.open(where / name, os.O_RDWR)  # a writer: an open that forgot O_NONBLOCK never hangs the test
    try:
        with pytest.raises(UnsafeFileError, match=f"{where / name}: is a FIFO"):
            _store(cache) if name != sampling.MANIFEST else sampling.stored_signatures(cache)
        result = CliRunner().invoke(app, ["verify", str(cache)])
        assert result.exit_code == 1 and "is a FIFO" in result.output, result.output
    finally:
        os.close(keep)


def test_bits_truncated_or_edited_under_a_reader_are_named(cache: Path) -> None:
    store = _store(cache)
    nvox = int(store.rows["nvox"][0])
    first = [len(s) for s in store.sets(0, nvox)]
    bits = _where(cache) / sampling.BITS
    data = bytearray(bits.read_bytes())
    data[8] ^= 0xFF
    with open(bits, "r+b") as f:  # in place, same size
        f.write(data)
    with pytest.raises(ChecksumError, match=f"{bits}: bytes 0-"):
        store.sets(0, nvox)
    os.truncate(bits, 16)
    with pytest.raises(ChecksumError, match=f"{bits}: 16 bytes, the manifest says"):
        store.sets(0, nvox)
    assert first and all(n > 0 for n in first)


def _reseal(where: Path, rows: Any, bits: bytes | None = None) -> None:
    """sets.npy (and bits.bin) written as crafted, the manifest's checksums made to match them."""
    if bits is not None:
        (where / sampling.BITS).write_bytes(bits)
    np.save(where / sampling.SETS, rows)
    doc = json.loads((where / sampling.MANIFEST).read_text())
    doc["files"] = {name: file_record(where / name) for name in (sampling.SETS, sampling.BITS)}
    doc["checksum"] = doc_checksum(doc)
    (where / sampling.MANIFEST).write_text(json.dumps(doc))


def _craft(how: str, rows: np.ndarray, bits: bytearray, size: int) -> tuple[Any, bytearray]:
    """Sets crafted six ways (issue 48, finding 7: each gave a bare exception or a read outside bounds)."""
    n = int(rows["nvox"][0])
    at, nbits = int(rows["offset"][0]), -(-n // 64) * 8
    cum = at + nbits  # item 0 set 0's running counts
    if how == "wrong-dtype":
        return rows.astype([(k, "<f8") for k in rows.dtype.names]), bits
    if how == "wrong-shape":
        return rows.reshape(len(rows) // 2, 2), bits
    if how == "offset-past-end":
        rows["offset"][-1] = size + 8
    elif how == "overlapping":
        rows["offset"][1] = rows["offset"][0]
    elif how == "negative-count":
        bits[cum + 8 : cum + 16] = np.int64(-5).tobytes()
    elif how == "voxel-out-of-range":  # a member past the label's voxels (the mask's padding, or a count too many)
        if n % 64:
            bits[at + nbits - 1] |= 0x80
        else:
            bits[cum + 8 * (n // sampling.BLOCK_BITS) : cum + 8 * (n // sampling.BLOCK_BITS + 1)] = np.int64(
                int(np.frombuffer(bytes(bits[cum : cum + 8 * (n // sampling.BLOCK_BITS + 1)]), "<i8")[-1]) + 1
            ).tobytes()
    return rows, bits


@pytest.mark.parametrize(
    "how", ["wrong-dtype", "wrong-shape", "offset-past-end", "overlapping", "negative-count", "voxel-out-of-range"]
)
def test_crafted_resealed_sets_are_one_line_naming_the_file(cache: Path, how: str) -> None:
    from loaders.errors import FormatError

    where = _where(cache)
    rows = np.load(where / sampling.SETS)
    bits = bytearray((where / sampling.BITS).read_bytes())
    rows, bits = _craft(how, rows, bits, len(bits))
    _reseal(where, rows, bytes(bits))
    with pytest.raises(FormatError) as got:  # at open, or at the first use of item 0's sets
        store = _store(cache)
        for s in store.sets(0, int(store.rows["nvox"][0])):
            for k in range(len(s)):
                s[k]
    msg = str(got.value)
    assert "\n" not in msg and str(where) in msg and "re-run `prep sampling`" in msg, msg


@pytest.mark.parametrize("which", ["sampling", "signature"])
def test_sets_are_never_written_through_a_linked_folder(cache: Path, tmp_path: Path, which: str) -> None:
    """`sampling/` or its signature folder swapped for a link to a folder elsewhere: making the sets again (what
    `prep cache` does after its commit, `prep sampling --force`) is refused in one line naming the folder, and
    nothing is written elsewhere; the workers' temporary file (under `sampling/`) is refused the same way."""
    from prep.pipeline import load_pipeline
    from prep.sampling import WorkerSets, ensure_sets

    pipeline = tmp_path / "pipeline.py"
    pipeline.write_text(CHAINS["posneg-3d"][2])
    (sig,) = sampling.stored_signatures(cache)
    where = _where(cache)
    moved, elsewhere = tmp_path / "moved", tmp_path / "elsewhere"
    elsewhere.mkdir()
    swapped = where.parent if which == "sampling" else where
    os.rename(swapped, moved)
    swapped.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(UnsafeFileError) as got:
        ensure_sets(cache, load_pipeline(pipeline).tail, workers=1, force=True)
    assert "\n" not in str(got.value) and str(swapped) in str(got.value) and "link" in str(got.value)
    if which == "sampling":
        with pytest.raises(UnsafeFileError, match="sampling"):
            WorkerSets(cache, dict(sig))
    assert list(elsewhere.rglob("*")) == []
