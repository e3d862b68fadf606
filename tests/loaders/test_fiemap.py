"""FIEMAP on real loop-mounted ext4/xfs: extents match `filefrag -e`, paging, flags; tmpfs/procfs refused."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loaders.blockmap.fiemap import (
    EXTENT_FLAGS,
    Extent,
    FiemapReader,
    fiemap,
    flag_names,
    merge_adjacent,
    unsafe_reasons,
)
from prep.errors import UnsupportedFilesystemError


def fragment(paths: list[Path], chunks: int, chunk: int = 4096) -> dict[Path, bytes]:
    """Interleave small appends (fsync after each) between files so the allocator splits each into many extents."""
    data = {p: b"" for p in paths}
    fds = {p: os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for p in paths}
    try:
        for i in range(chunks):
            for p, fd in fds.items():
                piece = bytes([(i * 7 + len(p.name)) % 256]) * chunk + os.urandom(16)
                os.write(fd, piece)
                os.fsync(fd)
                data[p] += piece
    finally:
        for fd in fds.values():
            os.close(fd)
    return data


def filefrag_extents(path: Path) -> list[tuple[int, int, int]]:
    """(logical, physical, length) in bytes, parsed from `filefrag -e -v` (which prints filesystem blocks)."""
    out = subprocess.run(["filefrag", "-e", "-v", str(path)], check=True, capture_output=True, text=True).stdout
    block = int(re.search(r"blocks of (\d+) bytes", out).group(1))  # type: ignore[union-attr]
    rows = re.findall(r"^\s*\d+:\s*(\d+)\.\.\s*\d+:\s*(\d+)\.\.\s*\d+:\s*(\d+):", out, re.M)
    return [(int(lo) * block, int(ph) * block, int(n) * block) for lo, ph, n in rows]


def reader_extents(path: Path) -> list[tuple[int, int, int, int]]:
    fd = os.open(path, os.O_RDONLY)
    try:
        return FiemapReader()(fd, str(path))
    finally:
        os.close(fd)


@pytest.mark.loopdev
@pytest.mark.parametrize("fstype", ["ext4", "xfs"])
def test_fragmented_extents_match_filefrag(make_loopfs: Callable[..., Any], fstype: str) -> None:
    fs = make_loopfs(fstype)
    paths = [fs.mountpoint / f"frag{i}" for i in range(3)]
    fragment(paths, chunks=12)
    for p in paths:
        ours = fiemap(p)
        assert len(ours) > 1, f"{p} was not fragmented: {ours}"
        assert [(e.logical, e.physical, e.length) for e in ours] == filefrag_extents(p)
        assert ours[-1].flags & EXTENT_FLAGS["LAST"]
        assert not any(e.flags & EXTENT_FLAGS["LAST"] for e in ours[:-1])
        # paging: one extent per ioctl gives the same list
        assert fiemap(p, batch=1) == ours
        assert fiemap(p, batch=2) == ours
        assert reader_extents(p) == [tuple(e) for e in ours]  # the fast reader pages the same way
    plain = fs.mountpoint / "plain"
    plain.write_bytes(os.urandom(5000))
    assert reader_extents(plain) == [tuple(e) for e in fiemap(plain)] and len(fiemap(plain)) == 1


@pytest.mark.loopdev
def test_sparse_empty_and_unwritten(make_loopfs: Callable[..., Any]) -> None:
    fs = make_loopfs("ext4")
    mnt: Path = fs.mountpoint
    (mnt / "empty").write_bytes(b"")
    assert fiemap(mnt / "empty") == [] == reader_extents(mnt / "empty")
    with open(mnt / "sparse", "wb") as f:
        f.seek(1 << 20)
        f.write(b"x" * 4096)
    (ext,) = fiemap(mnt / "sparse")
    assert ext.logical == 1 << 20 and ext.length == 4096
    with open(mnt / "prealloc", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 64 * 1024)
    exts = fiemap(mnt / "prealloc")
    assert exts and all(e.flags & EXTENT_FLAGS["UNWRITTEN"] for e in exts)
    assert "UNWRITTEN" in exts[0].flag_names


@pytest.mark.parametrize("path", ["/proc/self/status", "/dev/shm"])
def test_no_fiemap_names_the_file(path: str) -> None:
    if not os.path.exists(path):
        pytest.skip(f"{path} absent here")
    with pytest.raises(UnsupportedFilesystemError, match=re.escape(path)):
        fiemap(path)


def test_flag_decoding() -> None:
    assert flag_names(0x1 | 0x800) == ["LAST", "UNWRITTEN"]
    assert flag_names(0x10000) == ["0x10000"]
    assert unsafe_reasons(0x1 | 0x1000 | 0x2000) == []  # LAST, MERGED, SHARED are fine raw
    assert unsafe_reasons(0x200) == ["inline"]
    assert unsafe_reasons(0x200 | 0x100) == ["inline"]  # the kernel sets NOT_ALIGNED with DATA_INLINE
    assert unsafe_reasons(0x100) == ["not_aligned"]
    assert unsafe_reasons(0x80 | 0x8) == ["encrypted"]
    assert unsafe_reasons(0x4 | 0x800) == ["delalloc", "unwritten"]
    assert unsafe_reasons(0x10000) == ["flag_0x10000"]  # bits we do not know are never trusted


@st.composite
def extent_runs(draw: st.DrawFn) -> list[Extent]:
    n = draw(st.integers(1, 12))
    out, logical = [], 0
    for _ in range(n):
        logical += draw(st.sampled_from([0, 0, 4096]))  # sometimes a hole
        length = draw(st.integers(1, 8)) * 4096
        physical = draw(st.integers(0, 1000)) * 4096
        out.append(Extent(logical, physical, length, 0))
        logical += length
    return out


@given(extent_runs())
def test_merge_keeps_every_byte_in_place(extents: list[Extent]) -> None:
    def where(exts: list[Extent]) -> dict[int, int]:
        return {e.logical + i: e.physical + i for e in exts for i in range(0, e.length, 4096)}

    merged = merge_adjacent(extents)
    assert where(merged) == where(extents)
    assert len(merged) <= len(extents)
    for a, b in zip(merged, merged[1:]):  # nothing left that could still be merged
        assert not (a.end == b.logical and a.physical + a.length == b.physical)
