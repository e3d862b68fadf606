"""loaders.blockmap.bmap: the document (checksum, versions, corruption) and file-range -> device-range arithmetic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from loaders.blockmap.bmap import BlockMap, decode_document, encode_document, from_lba, map_range, to_lba
from loaders.errors import ChecksumError, FormatError, SchemaVersionError, StaleError

MB = 2048 * 512  # a partition starting at sector 2048


def doc_for(root: Path, files: dict[str, dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "format": "blockprep-bmap",
        "version": "1.0",
        "root": str(root),
        "device": "/dev/loop99",
        "disk": "/dev/loop99",
        "partition_start": 0,
        "logical_block_size": 512,
        "files": files,
        **extra,
    }


def test_document_round_trip_and_corruption(tmp_path: Path) -> None:
    doc = doc_for(tmp_path, {"a": {"size": 1, "inode": 2, "mtime_ns": 3, "extents": [], "raw_readable": True}})
    data = encode_document(doc)
    assert data.startswith(b'{"checksum":"xxh3:')
    assert decode_document(data) == doc  # the checksum member is checked and dropped
    assert json.loads(data)["checksum"].startswith("xxh3:")  # the file itself is plain JSON
    with pytest.raises(FormatError, match="truncated"):
        decode_document(data[:-20], "m.json")
    with pytest.raises(ChecksumError, match="m.json: checksum mismatch"):
        decode_document(data.replace(b'"size":1', b'"size":9'), "m.json")
    with pytest.raises(SchemaVersionError, match="version 2.0"):
        decode_document(encode_document(doc | {"version": "2.0"}), "m.json")
    assert decode_document(encode_document(doc | {"version": "1.7"}))["version"] == "1.7"  # minor: readable
    with pytest.raises(FormatError, match="not a blockprep block map"):
        decode_document(b'{"files": {}}', "m.json")
    with pytest.raises(FormatError, match="format 'other'"):
        decode_document(encode_document(doc | {"format": "other"}), "m.json")
    with pytest.raises(FormatError, match="cannot read"):
        BlockMap.load(tmp_path / "absent.json")


def test_entries_keys_and_staleness(tmp_path: Path) -> None:
    f = tmp_path / "data" / "x.bin"
    f.parent.mkdir()
    f.write_bytes(b"abc")
    st_ = f.stat()
    rec = {
        "size": 3,
        "inode": st_.st_ino,
        "mtime_ns": st_.st_mtime_ns,
        "ctime_ns": st_.st_ctime_ns,
        "extents": [[0, 8192, 4096, 1]],
    }
    path = tmp_path / "m.json"
    path.write_bytes(encode_document(doc_for(tmp_path / "data", {"x.bin": rec | {"raw_readable": True}})))
    bm = BlockMap.load(path)
    assert bm.key_for(str(f)) == "x.bin" == bm.key_for("x.bin") and "x.bin" in bm and len(bm) == 1
    assert bm.entry(str(f)).extents == ((0, 8192, 4096, 1),)
    with pytest.raises(FormatError, match="not in block map"):
        bm.key_for(str(tmp_path / "elsewhere"))
    assert bm.stale_reason("x.bin") is None and bm.check_fresh("x.bin").size == 3
    assert bm.segments("x.bin") == [(0, 3, 8192)]  # the last extent is clamped to the size
    assert bm.lba_ranges("x.bin", 1, 2) == [(1, 2, 16, 1, 1)]
    f.write_bytes(b"abcd")
    assert "size 3 -> 4" in (bm.stale_reason("x.bin") or "")
    with pytest.raises(StaleError, match="x.bin: changed since it was mapped"):
        bm.check_fresh("x.bin")
    f.unlink()
    assert "cannot stat" in (bm.stale_reason("x.bin") or "")
    moved = BlockMap.load(path, root=tmp_path / "new")
    assert moved.file_path("x.bin") == str(tmp_path / "new" / "x.bin")


def test_source_choice(tmp_path: Path) -> None:
    img = tmp_path / "fs.img"
    img.write_bytes(b"")
    doc = doc_for(
        tmp_path, {}, partition_start=4096, disk="/dev/loop98", loop={"backing_file": str(img), "offset": 512}
    )
    path = tmp_path / "m.json"
    path.write_bytes(encode_document(doc))
    bm = BlockMap.load(path)
    assert bm.source(img) == (str(img), 512 + 4096)
    assert bm.source("/dev/loop98") == ("/dev/loop98", 4096)
    assert bm.source("/dev/loop99") == ("/dev/loop99", 0)
    assert bm.source() == (str(img), 4608)  # /dev/loop99 does not exist: the image stands in
    with pytest.raises(FormatError, match="made on /dev/loop99"):
        bm.source(tmp_path / "m.json")


def test_map_range_errors() -> None:
    with pytest.raises(ValueError, match="outside the file"):
        map_range([(0, 0, 4096)], 100, 50, 51)
    assert map_range([], 0) == []
    assert map_range([], 10, 2, 3) == [(2, 3, None)]  # all hole


@st.composite
def file_layout(draw: st.DrawFn) -> tuple[list[tuple[int, int, int]], int]:
    extents, logical = [], 0
    for _ in range(draw(st.integers(0, 8))):
        logical += draw(st.sampled_from([0, 0, 4096, 3 * 4096]))  # holes between extents
        length = draw(st.integers(1, 6)) * 4096
        extents.append((logical, draw(st.integers(0, 1 << 20)) * 4096, length))
        logical += length
    # the file may end inside the last extent (clamped) or after it (a trailing hole)
    size = draw(st.integers(max(0, logical - 4095), logical + 3 * 4096))
    return extents, size


@given(file_layout(), st.data())
def test_segments_tile_the_range(layout: tuple[list[tuple[int, int, int]], int], data: st.DataObject) -> None:
    extents, size = layout
    offset = data.draw(st.integers(0, size))
    nbytes = data.draw(st.integers(0, size - offset))
    segs = map_range(extents, size, offset, nbytes)
    pos = offset
    for s in segs:  # contiguous, in order, no empty pieces
        assert s.file_offset == pos and s.nbytes > 0
        pos += s.nbytes
    assert pos == offset + nbytes
    where = {}  # byte -> device byte, from the extents directly
    for logical, physical, length in extents:
        for b in range(logical, min(logical + length, size)):
            where[b] = physical + b - logical
    for s in segs:
        for i in range(0, s.nbytes, 1021):  # sampled: every segment start and a stride through it
            b = s.file_offset + i
            assert where.get(b) == (None if s.device_offset is None else s.device_offset + i)
        if s.device_offset is not None:
            assert where.get(s.file_offset + s.nbytes - 1) == s.device_offset + s.nbytes - 1


@given(st.integers(0, 1 << 50), st.integers(1, 1 << 30), st.sampled_from([512, 4096]))
def test_lba_round_trip(offset: int, nbytes: int, block: int) -> None:
    lba, count, skip = to_lba(offset, nbytes, block)
    start, length = from_lba(lba, count, block)
    assert start + skip == offset and 0 <= skip < block
    assert start + length >= offset + nbytes > start + length - block  # covering and minimal
    if offset % block == 0 and nbytes % block == 0:
        assert (start, length) == (offset, nbytes) and skip == 0


def test_partition_start_applies_to_whole_disk_addresses(tmp_path: Path) -> None:
    rec: dict[str, Any] = {"size": 10000, "inode": 1, "mtime_ns": 1, "raw_readable": True}
    rec["extents"] = [[0, 40960, 8192, 0], [8192, 1 << 20, 4096, 1]]
    path = tmp_path / "m.json"
    path.write_bytes(encode_document(doc_for(tmp_path, {"f": rec}, partition_start=2048 * 512)))
    bm = BlockMap.load(path)
    assert bm.segments("f", 8000, 300) == [(8000, 192, 40960 + 8000), (8192, 108, 1 << 20)]
    assert bm.segments("f", 8000, 300, whole_disk=True) == [(8000, 192, MB + 48960), (8192, 108, MB + (1 << 20))]
    # LBAs address the whole disk by default (as a raw NVMe reader does); 512-byte blocks here
    assert bm.lba_ranges("f", 8000, 300) == [(8000, 192, (MB + 48960) // 512, 1, 320), (8192, 108, 4096, 1, 0)]
    assert bm.lba_ranges("f", 0, 512, whole_disk=False) == [(0, 512, 80, 1, 0)]
