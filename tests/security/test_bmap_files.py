"""A block map's keys name files under its root only, and a file rewritten, removed or moved on the disk
(e4defrag) after its first raw read is noticed at the next read call (real loop-mounted ext4; maps crafted
with checksums recomputed)."""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fsutil import fill_free_space, interleaved_appends

from loaders.backends import ReadRequest
from loaders.backends.blockdev import BlockdevBackend
from loaders.blockmap.bmap import BlockMap, encode_document
from loaders.errors import BackendError, FormatError
from prep.mapping import build_bmap

pytestmark = pytest.mark.loopdev
MiB = 1 << 20


@pytest.fixture
def mapped(make_loopfs: Callable[..., Any], tmp_path: Path) -> tuple[Any, Path]:
    fs = make_loopfs("ext4", size_mb=32, offset=MiB)
    (fs.mountpoint / "a").mkdir()
    (fs.mountpoint / "a" / "f.bin").write_bytes(b"old!" * 4096)
    build_bmap(fs.mountpoint, tmp_path / "m.json")
    return fs, tmp_path / "m.json"


@pytest.mark.parametrize("key", ["../outside.bin", "/etc/hostname", "a/../../outside.bin", "a/..", "a\x00b", ""])
def test_keys_outside_the_root_are_refused(mapped: tuple[Any, Path], key: str) -> None:
    _, path = mapped
    doc = json.loads(path.read_bytes())
    doc["files"][key] = doc["files"]["a/f.bin"]
    path.write_bytes(encode_document(doc))  # checksum recomputed: only the key check can refuse it
    with pytest.raises(FormatError, match="is not a path under the map's root"):
        BlockMap.load(path)


def _read(b: BlockdevBackend, batch: bool) -> bytes:
    reqs = [ReadRequest("a/f.bin", 0, 16384)]
    if batch:  # the batch path: several requests, coalesced
        reqs += [ReadRequest("a/f.bin", 4096, 4096), ReadRequest("a/f.bin", 8192, 4096)]
    return bytes(b.read(reqs)[0])


@pytest.mark.parametrize("batch", [False, True], ids=["one", "batch"])
@pytest.mark.parametrize("how", ["rewritten", "replaced", "removed"])
def test_a_file_changed_after_its_first_read_is_noticed(mapped: tuple[Any, Path], how: str, batch: bool) -> None:
    fs, path = mapped
    f = fs.mountpoint / "a" / "f.bin"
    with BlockdevBackend(path, device_path=fs.image) as b:
        assert _read(b, batch) == b"old!" * 4096  # checked, read raw
        if how == "rewritten":  # in place, same size: the device still holds the old bytes until writeback
            with open(f, "r+b") as out:
                out.write(b"new!" * 4096)
            os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 10**9))
        elif how == "replaced":
            (f.parent / "tmp").write_bytes(b"new!" * 4096)
            os.replace(f.parent / "tmp", f)
        else:
            f.unlink()
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            if how == "removed":
                with pytest.raises(BackendError, match="f.bin"):
                    _read(b, batch)
                return
            assert _read(b, batch) == b"new!" * 4096
        assert any("changed since it was mapped" in str(w.message) for w in record)


def test_blocks_moved_after_the_first_read_are_noticed(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    """e4defrag moves a file's blocks and keeps its inode, size, mtime and ctime: only its extents tell. A
    backend that read the file raw before must not read the blocks it left (now another file's bytes)."""
    import shutil
    import subprocess

    from loaders.blockmap.fiemap import fiemap

    if shutil.which("e4defrag") is None:
        pytest.skip("e4defrag missing (apt-get install e2fsprogs)")
    fs = make_loopfs("ext4", size_mb=32)
    mnt: Path = fs.mountpoint
    (mnt / "train" / "a").mkdir(parents=True)
    key = "train/a/victim.jpg"
    want = interleaved_appends(mnt, [key, "train/a/other.jpg"], rounds=12)[key]
    build_bmap(mnt, tmp_path / "m.json")
    with BlockdevBackend(tmp_path / "m.json", device_path=fs.image, threads=1) as b:
        assert bytes(b.read([ReadRequest(key, 0, len(want))])[0]) == want  # checked, read raw
        assert b.guard.why.get(key, "unchecked") is None
        before = fiemap(mnt / key)
        subprocess.run(["e4defrag", str(mnt / key)], check=True, capture_output=True)
        if [e[:3] for e in fiemap(mnt / key)] == [e[:3] for e in before]:
            pytest.skip("e4defrag left the file where it was")
        fill_free_space(mnt, 0xEE)  # the blocks the map points at now hold other bytes
        with pytest.warns(RuntimeWarning, match="victim.jpg: changed since it was mapped .*moved"):
            assert bytes(b.read([ReadRequest(key, 0, len(want))])[0]) == want
