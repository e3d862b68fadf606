"""Block maps (issue 48, findings 2, 3, 5, 6): a file rewritten in place with its mtime put back is stale (ctime);
the filesystem fallback and `BmapSource` never read through a link out of the mapped root; bmap.json is opened
as every layout file is (no link, no FIFO)."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fsutil import evict_tree

from loaders.backends import ReadRequest
from loaders.backends.blockdev import BlockdevBackend
from loaders.blockmap.bmap import BlockMap, encode_document
from loaders.errors import UnsafeFileError
from prep.mapping import build_bmap


@pytest.fixture
def mapped(make_loopfs: Callable[..., Any], tmp_path: Path) -> tuple[Any, Path]:
    """Two files on a loop-mounted ext4 under train/a, and the map of it."""
    fs = make_loopfs("ext4")
    (fs.mountpoint / "train" / "a").mkdir(parents=True)
    for name in ("x.bin", "y.bin"):
        (fs.mountpoint / "train" / "a" / name).write_bytes(b"\x11" * 8192)
    os.sync()  # the mapped bytes are on the device
    build_bmap(fs.mountpoint, tmp_path / "m.json")
    return fs, tmp_path / "m.json"


@pytest.mark.loopdev
def test_a_rewrite_in_place_with_mtime_restored_is_stale_and_read_new(mapped: tuple[Any, Path]) -> None:
    fs, bmap = mapped
    path = fs.mountpoint / "train" / "a" / "x.bin"
    st = path.stat()
    with open(path, "r+b") as f:  # same size, same inode, same blocks; the new bytes only in the page cache
        f.write(b"\x22" * 8192)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # as `cp -p`, `rsync -t`, `tar x` put it back
    now = path.stat()
    assert (now.st_size, now.st_ino, now.st_mtime_ns) == (st.st_size, st.st_ino, st.st_mtime_ns)
    assert "ctime changed" in (BlockMap.load(bmap).stale_reason("train/a/x.bin") or "")
    with BlockdevBackend(bmap, device_path=fs.image) as backend:
        with pytest.warns(RuntimeWarning, match="x.bin: changed since it was mapped .*ctime changed"):
            got = backend.read([ReadRequest("train/a/x.bin", 0, 8192)])[0]
        assert bytes(got) == b"\x22" * 8192  # the device still holds 0x11 until writeback


@pytest.mark.loopdev
def test_a_dirty_file_its_map_still_matches_is_written_back_before_a_raw_read(mapped: tuple[Any, Path]) -> None:
    """The case the stat check cannot see: a map whose record is the file's stat now while its new bytes are
    only in the page cache (a map or a check made in the timestamp tick of a write: coarse clocks leave ctime
    as it was). The record is made to match here; the raw read writes the dirty pages back first."""
    fs, bmap = mapped
    path = fs.mountpoint / "train" / "a" / "x.bin"
    with open(path, "r+b") as f:  # same size, inode and blocks; no fsync
        f.write(b"\x33" * 8192)
    with open(fs.image, "rb") as image:  # the device still holds the old bytes
        assert b"\x33" * 8192 not in image.read()
    doc = json.loads(bmap.read_bytes())
    st = path.stat()
    doc["files"]["train/a/x.bin"].update(mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns)
    bmap.write_bytes(encode_document(doc))
    assert BlockMap.load(bmap).stale_reason("train/a/x.bin") is None  # fresh by every stat field and extent
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # read raw: no fallback warning
        with BlockdevBackend(bmap, device_path=fs.image) as backend:
            got = backend.read([ReadRequest("train/a/x.bin", 0, 8192)])[0]
            assert backend.guard.why["train/a/x.bin"] is None
    assert bytes(got) == b"\x33" * 8192


@pytest.mark.loopdev
@pytest.mark.parametrize("what", ["file", "folder"])
def test_a_mapped_file_or_folder_swapped_for_a_link_out_of_the_root_is_refused(
    mapped: tuple[Any, Path], tmp_path: Path, what: str
) -> None:
    fs, bmap = mapped
    secret = tmp_path / "outside" / "a"
    secret.mkdir(parents=True)
    for name in ("x.bin", "y.bin"):
        (secret / name).write_bytes(b"\x99" * 8192)  # same size: only the link gives it away
        (secret / name).chmod(0o600)
    at = fs.mountpoint / "train" / "a"
    if what == "file":
        (at / "x.bin").unlink()
        (at / "x.bin").symlink_to(secret / "x.bin")
    else:
        for name in ("x.bin", "y.bin"):
            (at / name).unlink()
        at.rmdir()
        at.symlink_to(secret)
    refused = pytest.raises(UnsafeFileError, match=r"train/a(/x.bin)?: is a symlink.*links are never followed")
    with BlockdevBackend(bmap, device_path=fs.image) as backend, refused:
        backend.read([ReadRequest("train/a/x.bin", 0, 8192)])


@pytest.mark.loopdev
def test_bmap_source_lists_and_reads_no_link_out_of_its_root(mapped: tuple[Any, Path], tmp_path: Path) -> None:
    from loaders.faces.dali import BmapSource

    fs, bmap = mapped
    (tmp_path / "outside" / "c").mkdir(parents=True)
    (tmp_path / "outside" / "c" / "z.bin").write_bytes(b"\x99" * 100)
    (tmp_path / "outside" / "w.bin").write_bytes(b"\x99" * 100)
    (fs.mountpoint / "train" / "b").symlink_to(tmp_path / "outside" / "c")  # a class folder elsewhere
    (fs.mountpoint / "train" / "a" / "w.bin").symlink_to(tmp_path / "outside" / "w.bin")  # a file elsewhere
    with BmapSource(bmap, batch_size=8, folder="train", file_filters=["*.bin"]) as src:
        assert [p for p, _ in src.files] == ["a/x.bin", "a/y.bin"]
        evict_tree(fs.mountpoint)
        data, _ = src._batch([0, 1])
        assert [bytes(d) for d in data] == [b"\x11" * 8192] * 2
    (fs.mountpoint / "via").symlink_to(tmp_path / "outside")
    with pytest.raises(UnsafeFileError, match=r"via: is a symlink, where a folder of the block map's root"):
        BmapSource(bmap, folder="via")


def test_bmap_json_as_a_fifo_or_a_link_is_refused(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "bmap.json")
    keep = os.open(tmp_path / "bmap.json", os.O_RDWR)  # a writer: an open that forgot O_NONBLOCK never hangs
    try:
        with pytest.raises(UnsafeFileError, match=r"bmap.json: is a FIFO"):
            BlockMap.load(tmp_path / "bmap.json")
    finally:
        os.close(keep)
    (tmp_path / "real.json").write_text("{}")
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    with pytest.raises(UnsafeFileError, match=r"link.json: is a symlink"):
        BlockMap.load(tmp_path / "link.json")
