"""A shard swapped after its cache was opened (a symlink, another file, a FIFO) or hard-linked to a file
outside the cache is refused in one line by every reader that opens shards by path, and by `prep verify`."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from craft import copy_cache
from typer.testing import CliRunner

from loaders import FormatError, PreparedCache, PreparedDataset
from prep.cli import app

BACKENDS = ["posix", "direct"]


def _shard(cache: Path) -> Path:
    """The shard that holds item 0 (the one each test reads)."""
    return Path(PreparedCache(cache).entries(0)[0].shard)


def _region(ds: PreparedDataset) -> None:
    key = ds.keys[0]
    shape = ds.cache.entries(0)[0].shape
    ds.read_region(0, key, [0] * len(shape), [1] * len(shape))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("swap", ["symlink", "renamed-copy"])
def test_a_shard_swapped_after_open_is_refused(good_cache: Path, tmp_path: Path, backend: str, swap: str) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    ds = PreparedDataset(cache, backend=backend, meta=False)
    shard = _shard(cache)
    twin = tmp_path / "twin.bin"
    shutil.copyfile(shard, twin)  # the same bytes: checksums cannot be what refuses it
    if swap == "symlink":
        shard.unlink()
        shard.symlink_to(twin)
    else:
        os.replace(twin, shard)
    with pytest.raises(FormatError, match="shard"):
        ds[0]
    with pytest.raises(FormatError, match="shard"):
        _region(ds)


def test_a_fifo_swapped_in_after_open_is_refused_without_hanging(good_cache: Path, tmp_path: Path) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    ds = PreparedDataset(cache, backend="posix", meta=False)
    shard = _shard(cache)
    shard.unlink()
    os.mkfifo(shard)
    caught: list[BaseException] = []

    def read() -> None:
        try:
            ds[0]
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            caught.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(20)
    if reader.is_alive():  # unblock the reader before failing (open for writing releases a FIFO's reader)
        os.close(os.open(shard, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(5)
        pytest.fail("ds[0] hung on a FIFO swapped in for a shard")
    assert caught and isinstance(caught[0], FormatError), caught
    assert "not a regular file" in str(caught[0])


def test_a_hard_linked_shard_is_refused_on_open_and_by_verify(good_cache: Path, tmp_path: Path) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    os.link(_shard(cache), tmp_path / "outside.bin")
    with pytest.raises(FormatError, match="has 2 links; copy the cache with `cp -r`"):
        PreparedDataset(cache)
    result = CliRunner().invoke(app, ["verify", str(cache)])
    assert result.exit_code == 1, result.output
    assert "has 2 links" in result.output, result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hard_link_made_after_open_is_refused_on_read(good_cache: Path, tmp_path: Path, backend: str) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    ds = PreparedDataset(cache, backend=backend, meta=False)
    os.link(_shard(cache), tmp_path / "outside.bin")
    with pytest.raises(FormatError, match="has 2 links"):
        ds[0]
