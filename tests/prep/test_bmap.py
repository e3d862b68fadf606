"""`prep bmap` on real loop-mounted ext4/xfs images: every kind of file, seed form, verify, stale, bad input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from loaders.blockmap.bmap import BlockMap
from loaders.blockmap.fiemap import fiemap
from prep.cli import app
from prep.errors import UnsupportedFilesystemError, UsageError
from prep.mapping import build_bmap, seed_from_bmap, skipped_path, verify_bmap

runner = CliRunner()
MiB = 1 << 20


def fragment(paths: list[Path], chunks: int, chunk: int = 4096) -> dict[Path, bytes]:
    """Interleave small appends (fsync after each) between files so each gets many extents."""
    data = {p: b"" for p in paths}
    fds = {p: os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644) for p in paths}
    try:
        for _ in range(chunks):
            for p, fd in fds.items():
                piece = os.urandom(chunk - 100) + bytes(100)
                os.write(fd, piece)
                os.fsync(fd)
                data[p] += piece
    finally:
        for fd in fds.values():
            os.close(fd)
    return data


def populate(mnt: Path) -> dict[str, bytes]:
    """A small tree with fragmented, sparse, empty, plain and nested files; returns key -> content."""
    (mnt / "train" / "a").mkdir(parents=True)
    (mnt / "train" / "b").mkdir()
    content: dict[str, bytes] = {}
    for p, data in fragment([mnt / "train" / "a" / "frag0.bin", mnt / "train" / "b" / "frag1.bin"], 10).items():
        content[str(p.relative_to(mnt))] = data
    for i in range(5):
        data = os.urandom(3000 + 1000 * i)
        (mnt / "train" / "a" / f"img{i}.jpg").write_bytes(data)
        content[f"train/a/img{i}.jpg"] = data
    with open(mnt / "sparse.bin", "wb") as f:  # hole, data, hole
        f.seek(MiB)
        f.write(b"\x07" * 5000)
        f.truncate(3 * MiB)
    content["sparse.bin"] = bytes(MiB) + b"\x07" * 5000 + bytes(3 * MiB - MiB - 5000)
    (mnt / "empty").write_bytes(b"")
    content["empty"] = b""
    os.sync()
    return content


def raw_bytes(image: Path, base: int, extents: list[list[int]], size: int) -> bytes:
    """Rebuild a file from its extents by reading the image file directly (holes as zeros)."""
    out = bytearray(size)
    with open(image, "rb") as f:
        for logical, physical, length, _flags in extents:
            n = min(length, size - logical)
            if n > 0:
                f.seek(base + physical)
                out[logical : logical + n] = f.read(n)
    return bytes(out)


@pytest.mark.loopdev
@pytest.mark.parametrize("fstype", ["ext4", "xfs"])
def test_full_map_is_exact(make_loopfs: Callable[..., Any], tmp_path: Path, fstype: str) -> None:
    fs = make_loopfs(fstype, offset=MiB)
    content = populate(fs.mountpoint)
    out = tmp_path / "bmap.json"
    seen: list[int] = []
    summary = build_bmap(fs.mountpoint, out, workers=3, progress=seen.append)
    assert summary.files == len(content) == sum(seen)
    assert summary.bytes == sum(len(v) for v in content.values())
    assert summary.skipped == {} and summary.raw_readable == len(content)
    doc = BlockMap.load(out).doc
    assert doc["device"] == fs.device and doc["fstype"] == fstype and doc["loop"]["offset"] == MiB
    assert doc["loop"]["backing_file"] == str(fs.image) and doc["uuid"]
    assert (
        doc["uuid"]
        == subprocess.run(
            ["blkid", "-p", "-o", "value", "-s", "UUID", fs.device], capture_output=True, text=True
        ).stdout.strip()
    )
    files = doc["files"]
    assert set(files) == set(content)
    for key, rec in files.items():
        assert rec["raw_readable"], (key, rec)
        assert [tuple(e) for e in rec["extents"]] == [
            (e.logical, e.physical, e.length, e.flags) for e in fiemap(fs.mountpoint / key)
        ]
        # the FIEMAP addresses plus the loop offset give the file's bytes straight from the image file
        assert raw_bytes(fs.image, MiB, rec["extents"], rec["size"]) == content[key], key
    assert len(files["train/a/frag0.bin"]["extents"]) > 1
    assert files["empty"]["extents"] == [] and files["sparse.bin"]["extents"][0][0] == MiB
    assert verify_bmap(out) == []
    assert verify_bmap(out, fs.image) == []  # through the image file, as a user without root would


@pytest.mark.loopdev
def test_inline_and_unwritten_are_filesystem_only(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    fs = make_loopfs("ext4", mkfs_args=("-O", "inline_data"))
    mnt: Path = fs.mountpoint
    (mnt / "tiny.txt").write_bytes(b"hello")
    with open(mnt / "prealloc.bin", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 256 * 1024)
    (mnt / "tail_prealloc.bin").write_bytes(os.urandom(8192))
    # unwritten space beyond EOF (KEEP_SIZE) holds no file bytes: the file stays raw-readable
    subprocess.run(["fallocate", "-n", "-o", "8192", "-l", "65536", str(mnt / "tail_prealloc.bin")], check=True)
    (mnt / "plain.bin").write_bytes(os.urandom(20000))
    os.sync()
    summary = build_bmap(mnt, tmp_path / "m.json")
    files = BlockMap.load(tmp_path / "m.json").doc["files"]
    assert (files["tiny.txt"]["raw_readable"], files["tiny.txt"]["reason"]) == (False, "inline")
    assert (files["prealloc.bin"]["raw_readable"], files["prealloc.bin"]["reason"]) == (False, "unwritten")
    assert files["tail_prealloc.bin"]["raw_readable"], files["tail_prealloc.bin"]
    assert any(e[3] & 0x800 for e in files["tail_prealloc.bin"]["extents"])
    assert files["plain.bin"]["raw_readable"]
    assert summary.skipped == {"inline": 1, "unwritten": 1}
    assert "1 inline" in summary.line() and "1 unwritten" in summary.line()
    assert verify_bmap(tmp_path / "m.json") == []  # filesystem-only files are not read raw


@pytest.mark.loopdev
def test_seed_format(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    fs = make_loopfs("ext4", offset=MiB, mkfs_args=("-O", "inline_data"))
    content = populate(fs.mountpoint)
    (fs.mountpoint / "tiny.txt").write_bytes(b"hi")
    out = tmp_path / "bmap.seed.json"
    summary = build_bmap(fs.mountpoint, out, fmt="seed")
    seed = json.loads(out.read_text())
    skipped = json.loads(skipped_path(out).read_text())
    assert skipped == {
        "empty": "empty",
        "sparse.bin": "hole",
        "tiny.txt": "inline",
        "train/a/frag0.bin": "fragmented",
        "train/b/frag1.bin": "fragmented",
    }
    assert summary.skipped == {"empty": 1, "hole": 1, "inline": 1, "fragmented": 2}
    assert set(seed) == {f"train/a/img{i}.jpg" for i in range(5)} == set(content) - set(skipped)
    lbs = int(Path(f"/sys/block/{Path(fs.device).name}/queue/logical_block_size").read_text())
    with open(fs.image, "rb") as f:
        for key, span in seed.items():
            size = len(content[key])
            assert (span["endblock"] - span["startblock"] + 1) * lbs == -(-size // lbs) * lbs  # inclusive end
            f.seek(MiB + span["startblock"] * lbs)  # no partition here; the loop offset is the image's
            assert f.read(size) == content[key], key
    # converting an existing full map gives the same seed
    build_bmap(fs.mountpoint, tmp_path / "full.json")
    n, skipped2 = seed_from_bmap(tmp_path / "full.json", tmp_path / "again.json")
    assert n == len(seed) and skipped2 == skipped
    assert json.loads((tmp_path / "again.json").read_text()) == seed


@pytest.mark.loopdev
def test_stale_files_are_reported_by_verify(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    fs = make_loopfs("xfs")
    populate(fs.mountpoint)
    out = tmp_path / "bmap.json"
    build_bmap(fs.mountpoint, out)
    target = fs.mountpoint / "train" / "a" / "img1.jpg"
    tmp = target.with_suffix(".new")
    tmp.write_bytes(os.urandom(9000))
    os.replace(tmp, target)  # rewrite-and-rename: new inode, new blocks
    mismatches = verify_bmap(out)
    assert [m.key for m in mismatches] == ["train/a/img1.jpg"]
    assert "changed since it was mapped" in str(mismatches[0]) and str(target) in str(mismatches[0])
    result = runner.invoke(app, ["bmap", "verify", str(out)])
    assert result.exit_code == 1, result.output
    assert "img1.jpg" in result.output and "1 mismatch" in result.output


@pytest.mark.loopdev
def test_globs_subdirs_nested_mounts_and_own_output(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    fs = make_loopfs("ext4")
    content = populate(fs.mountpoint)
    with pytest.raises(UsageError, match="not a mountpoint"):
        build_bmap(fs.mountpoint / "train", tmp_path / "x.json")
    s = build_bmap(fs.mountpoint / "train", tmp_path / "sub.json", require_mountpoint=False, include=["*.jpg"])
    assert set(BlockMap.load(tmp_path / "sub.json").files) == {f"a/img{i}.jpg" for i in range(5)}
    assert s.files == 5
    build_bmap(fs.mountpoint, tmp_path / "ex.json", exclude=["train/b", "*.bin"])
    assert set(BlockMap.load(tmp_path / "ex.json").files) == {k for k in content if k.startswith("train/a/img")} | {
        "empty"
    }
    # a map written inside the tree does not map itself; a tmpfs mounted inside is another device: not entered
    (fs.mountpoint / "other").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(fs.mountpoint / "other")], check=True)
    try:
        (fs.mountpoint / "other" / "x").write_bytes(b"x")
        build_bmap(fs.mountpoint, fs.mountpoint / "bmap.json")
        build_bmap(fs.mountpoint, fs.mountpoint / "bmap.json")
        for _ in range(2):
            build_bmap(fs.mountpoint, fs.mountpoint / "s.json", fmt="seed", exclude=["bmap.json"])
    finally:
        subprocess.run(["umount", str(fs.mountpoint / "other")], check=True)
    assert set(BlockMap.load(fs.mountpoint / "bmap.json").files) == set(content)
    seeded = set(json.loads((fs.mountpoint / "s.json").read_text()))
    seeded |= set(json.loads((fs.mountpoint / "s.skipped.json").read_text()))
    assert seeded == set(content)


def test_unsupported_and_missing(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such directory"):
        build_bmap(tmp_path / "nope", tmp_path / "b.json")
    with pytest.raises(UnsupportedFilesystemError, match="/dev/shm"):
        build_bmap(Path("/dev/shm"), tmp_path / "b.json")
    with pytest.raises(UsageError, match="unknown format"):
        build_bmap(tmp_path, tmp_path / "b.json", fmt="xml")
    with pytest.raises(UsageError, match="parent directory"):
        build_bmap(tmp_path, tmp_path / "no" / "b.json", require_mountpoint=False)


# --- CLI: exit codes and one-line errors naming the path


def one_line_error(result: Any, *needles: str) -> None:
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, result.output
    for needle in needles:
        assert needle in lines[0], result.output


@pytest.mark.parametrize("where", ["missing", "/proc", "/dev/shm"])
def test_cli_bad_directories(tmp_path: Path, where: str) -> None:
    path = str(tmp_path / "missing") if where == "missing" else where
    result = runner.invoke(app, ["bmap", "--mountpoint", path, "--output", str(tmp_path / "b.json")])
    one_line_error(result, path)
    assert not (tmp_path / "b.json").exists()


def test_cli_needs_mountpoint() -> None:
    one_line_error(runner.invoke(app, ["bmap"]), "--mountpoint")


@pytest.mark.loopdev
def test_cli_map_verify_and_corrupt_maps(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    fs = make_loopfs("ext4")
    populate(fs.mountpoint)
    out = tmp_path / "bmap.json"
    result = runner.invoke(app, ["bmap", "--mountpoint", str(fs.mountpoint), "--output", str(out), "--workers", "2"])
    assert result.exit_code == 0, result.output
    assert re.search(r"9 files, \d+ bytes, \d+ extents; 9 raw-readable; skipped: none; [\d,]+ files/s", result.output)
    one_line_error(runner.invoke(app, ["bmap", "--mountpoint", str(fs.mountpoint / "train")]), "not a mountpoint")
    seed = tmp_path / "seed.json"
    args = ["--format", "seed", "--output", str(seed), "--allow-subdir", "--include", "*.jpg", "--exclude", "*img4*"]
    result = runner.invoke(app, ["bmap", "--mountpoint", str(fs.mountpoint / "train"), *args])
    assert result.exit_code == 0, result.output
    assert set(json.loads(seed.read_text())) == {f"a/img{i}.jpg" for i in range(4)}
    assert "seed.skipped.json" in result.output
    result = runner.invoke(app, ["bmap", "verify", str(out), "--device", str(fs.image)])
    assert result.exit_code == 0 and "ok:" in result.output, result.output
    one_line_error(runner.invoke(app, ["bmap", "verify", str(out), "--device", "/dev/null"]), "/dev/null", "made on")
    good = out.read_bytes()
    (tmp_path / "trunc.json").write_bytes(good[: len(good) // 2])
    one_line_error(runner.invoke(app, ["bmap", "verify", str(tmp_path / "trunc.json")]), "trunc.json", "truncated")
    (tmp_path / "edit.json").write_bytes(good.replace(b'"size":3000', b'"size":3001'))
    one_line_error(runner.invoke(app, ["bmap", "verify", str(tmp_path / "edit.json")]), "edit.json", "checksum")
    (tmp_path / "future.json").write_bytes(good.replace(b'"version":"1.1"', b'"version":"2.0"'))
    one_line_error(runner.invoke(app, ["bmap", "verify", str(tmp_path / "future.json")]), "future.json", "version")
    one_line_error(runner.invoke(app, ["bmap", "verify", str(tmp_path / "none.json")]), "none.json")
    # a map of another filesystem image
    other = make_loopfs("ext4", size_mb=32)
    one_line_error(runner.invoke(app, ["bmap", "verify", str(out), "--device", str(other.image)]), str(other.image))


@pytest.mark.loopdev
def test_cli_permission_denied_keeps_the_old_map(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    fs = make_loopfs("ext4")
    populate(fs.mountpoint)
    out = tmp_path / "bmap.json"
    build_bmap(fs.mountpoint, out)
    good = out.read_bytes()
    secret = fs.mountpoint / "train" / "a" / "img2.jpg"
    secret.chmod(0)
    # root reads everything: drop the capabilities that let it, as an ordinary user would be
    cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]
    cli = [sys.executable, "-m", "prep", "bmap", "--mountpoint", str(fs.mountpoint), "--output", str(out)]
    proc = subprocess.run(cmd + cli, capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("error:") == 1 and str(secret) in proc.stderr and "Permission denied" in proc.stderr
    assert out.read_bytes() == good  # nothing partial replaced the good map
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".bmap.json.tmp")]


@pytest.mark.loopdev
def test_parallel_maps_equal_serial(make_loopfs: Callable[..., Any], monkeypatch: pytest.MonkeyPatch) -> None:
    import threading
    from concurrent.futures import ProcessPoolExecutor

    from prep.mapping import walk as bmap

    fs = make_loopfs("ext4")
    populate(fs.mountpoint)
    for i in range(600):
        (fs.mountpoint / "train" / "b" / f"s{i}").write_bytes(b"y" * (i * 37 % 9000))
    serial = bmap.map_tree(fs.mountpoint, workers=1)
    assert bmap.map_tree(fs.mountpoint, workers=3) == serial  # threads (a small tree)
    monkeypatch.setattr(bmap, "PROCESS_MIN_FILES", 100)  # the large-tree path: worker processes
    if threading.active_count() == 1:
        with bmap._executor(2, large=True) as pool:
            assert isinstance(pool, ProcessPoolExecutor)
    assert bmap.map_tree(fs.mountpoint, workers=3) == serial
    assert len(serial) == 609


_extent = st.tuples(
    st.integers(0, 1 << 40),
    st.integers(0, 1 << 50),
    st.integers(1, 1 << 30),
    st.sampled_from([0, 1, 0x200 | 0x100, 0x800, 0x1001, 0x4000]),
)


@settings(max_examples=200, deadline=None)
@given(
    size=st.integers(0, 1 << 40),
    inode=st.integers(1, 1 << 40),
    mtime=st.integers(0, 1 << 62),
    extents=st.lists(_extent, max_size=4),
    xxh3=st.none() | st.integers(0, (1 << 64) - 1),
)
def test_record_json_is_canonical_json(
    size: int, inode: int, mtime: int, extents: list[tuple[int, int, int, int]], xxh3: int | None
) -> None:
    from prep.mapping import classify, record_json

    reason = classify(extents, size)
    rec: dict[str, Any] = {
        "size": size,
        "inode": inode,
        "mtime_ns": mtime,
        "extents": [list(e) for e in extents],
        "reason": reason,
        "raw_readable": reason is None,
    }
    if xxh3 is not None:
        rec["xxh3"] = xxh3
    assert record_json(size, inode, mtime, extents, xxh3) == json.dumps(rec, sort_keys=True, separators=(",", ":"))


def test_preformatted_files_encode_as_the_whole_document() -> None:
    from loaders.blockmap.bmap import decode_document, encode_document, encode_document_with_files
    from prep.mapping.walk import _Mapped, _ordered, files_json, record_json

    # keys whose escaped forms sort differently from the keys themselves, and every kind of escape
    keys = ["a.txt", "a/b", "~", "é/x", 'q"uote', "back\\slash", "tab\there", "del\x7f", "z\udcff", "日本"]
    records = {k: record_json(10 + i, i + 1, 5, [(0, 4096 * i, 4096, 1)]) for i, k in enumerate(keys)}
    header = {"format": "blockprep-bmap", "version": "1.0", "root": "/r\u00e9", "device": "/dev/x", "zz": None}
    whole = header | {"files": {k: json.loads(records[k]) for k in keys}}

    def piece(ks: list[str]) -> tuple[str, str, str]:
        return (ks[0], ks[-1], ",".join(f"{json.dumps(k)}:{records[k]}" for k in ks))

    split = sorted(keys)
    apart = [piece(split[i : i + 3]) for i in range(0, len(split), 3)][::-1]  # ranges apart, arriving reversed
    interleaved = [piece(sorted(keys[0::2])), piece(sorted(keys[1::2]))]  # key ranges overlap: file by file
    for pieces in (apart, interleaved):
        m = _ordered(_Mapped(keys=list(keys), records=[records[k] for k in keys], pieces=pieces))
        data = encode_document_with_files(header, files_json(m))
        assert data == encode_document(whole)
        assert decode_document(data) == whole


@pytest.mark.loopdev
def test_file_deleted_while_mapping_is_left_out_and_counted(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    fs = make_loopfs("ext4")
    folder = fs.mountpoint / "many"
    folder.mkdir()
    for i in range(300):  # more than one mapping batch: the folder is listed once, mapped in two batches
        (folder / f"f{i:03d}").write_bytes(b"x" * 100)
    doomed = folder / "f299"

    def delete_once(n: int) -> None:  # after the first batch is mapped, before the second is opened
        if doomed.exists():
            doomed.unlink()

    summary = build_bmap(fs.mountpoint, tmp_path / "m.json", workers=1, progress=delete_once)
    assert summary.vanished == ["many/f299"] and summary.files == 299
    assert "1 file(s) deleted while the tree was mapped" in (summary.warning() or "")
    assert "many/f299" not in BlockMap.load(tmp_path / "m.json") and "many/f298" in BlockMap.load(tmp_path / "m.json")


def test_cli_bmap_progress_lines_without_a_tty(tmp_path: Path) -> None:
    (tmp_path / "t").mkdir()
    for i in range(3):
        (tmp_path / "t" / f"{i}.bin").write_bytes(b"y" * 10)
    result = runner.invoke(
        app, ["bmap", "--mountpoint", str(tmp_path / "t"), "--allow-subdir", "--output", str(tmp_path / "m.json")]
    )
    if result.exit_code == 1 and "mappable" in result.output + str(result.stderr if result.stderr_bytes else ""):
        pytest.skip("tmp_path is not on a mappable filesystem")
    assert result.exit_code == 0, result.output
    assert "prep bmap: 3 files" in result.stderr and "3 files, 30 bytes" in result.stdout
