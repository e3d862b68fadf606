"""Sampling sets (issue 48, findings 5, 6, 7, 8): checked by `prep verify` against the cached label they were made
from (foreground and background swapped and resealed fail it), opened as every layout file is (no link, no FIFO),
and read and checked again on every use (a bits.bin truncated under a reader is an error, never SIGBUS)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

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
