"""BlockdevBackend on real loop-mounted ext4/xfs: raw reads through the map equal the filesystem's bytes."""

from __future__ import annotations

import json
import os
import pickle
import random
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from forkutil import forked_exit
from fsutil import evict_tree, fill_free_space, interleaved_appends

from loaders.backends import ReadRequest, get_backend
from loaders.backends.blockdev import BlockdevBackend, RawDevice
from loaders.backends.mapped import WriteClock
from loaders.blockmap.bmap import BlockMap
from loaders.errors import BackendError
from prep.mapping import build_bmap

MiB = 1 << 20
pytestmark = pytest.mark.loopdev


def make_tree(mnt: Path) -> dict[str, bytes]:
    """Fragmented, sparse, odd-sized, empty and nested files; returns key -> content."""
    content: dict[str, bytes] = {}
    (mnt / "d").mkdir()
    content.update(interleaved_appends(mnt, ["d/frag0", "d/frag1"], rounds=8))  # many extents per file
    for i, n in enumerate([1, 511, 4096, 4097, 70001]):
        content[f"odd{i}"] = os.urandom(n)
        (mnt / f"odd{i}").write_bytes(content[f"odd{i}"])
    with open(mnt / "sparse", "wb") as f:
        f.seek(12288 + 100)
        f.write(b"\x55" * 9000)
        f.truncate(64 * 1024)
    content["sparse"] = bytes(12388) + b"\x55" * 9000 + bytes(64 * 1024 - 12388 - 9000)
    content["empty"] = b""
    (mnt / "empty").write_bytes(b"")
    return content


@pytest.fixture(params=["ext4", "xfs"])
def mapped(request: pytest.FixtureRequest, make_loopfs: Callable[..., Any], tmp_path: Path) -> tuple[Any, Path, dict]:
    """A loop filesystem at a 1 MiB offset of its image, a tree on it, and its bmap."""
    fs = make_loopfs(request.param, offset=MiB)
    content = make_tree(fs.mountpoint)
    out = tmp_path / "bmap.json"
    build_bmap(fs.mountpoint, out)
    return fs, out, content


def requests_for(root: Path, content: dict[str, bytes], seed: int = 0) -> list[ReadRequest]:
    rng = random.Random(seed)
    reqs = [ReadRequest(str(root / k), 0, len(v)) for k, v in content.items()]
    for k, v in content.items():  # unaligned sub-ranges, some across extent boundaries and holes
        for _ in range(6):
            off = rng.randrange(0, len(v) + 1)
            reqs.append(ReadRequest(k, off, rng.randrange(0, len(v) - off + 1)))
    return reqs


@pytest.mark.parametrize(
    ("via", "coalesce"), [("device", 1 << 20), ("image", 1 << 20), ("image", 0), ("default", 1 << 20)]
)
def test_raw_reads_match_the_filesystem(mapped: tuple[Any, Path, dict], via: str, coalesce: int) -> None:
    fs, out, content = mapped
    device = {"image": fs.image, "device": fs.device, "default": None}[via]
    b = BlockdevBackend(out, device_path=device, threads=8, coalesce=coalesce)
    with b:
        assert b.source.base == (0 if via == "device" else MiB)
        # by default a loop device is read as its image, through the page cache its driver reads it through
        assert (b.source.path, b._raw.direct) == ((str(fs.image), False) if via == "default" else (str(device), True))
        reqs = requests_for(fs.mountpoint, content)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # every file here is raw-readable: no fallback may happen
            bufs = b.read(reqs)
        for req, buf in zip(reqs, bufs):
            key = os.path.relpath(req.path, fs.mountpoint) if os.path.isabs(req.path) else req.path
            assert bytes(buf) == content[key][req.offset : req.offset + req.nbytes], req


def _raw_reads_in_a_forked_child(b: Any, reqs: list[ReadRequest], want: list[bytes]) -> None:
    sys.exit(0 if [bytes(x) for x in b.read(reqs)] == want else 3)


def test_a_forked_child_reads_after_the_parent_did(mapped: tuple[Any, Path, dict]) -> None:
    """A DataLoader worker forked after the parent read raw: the parent's read and stat pools have no threads in
    the child, which makes its own."""
    fs, out, content = mapped
    reqs = requests_for(fs.mountpoint, content)
    want = [content[os.path.relpath(r.path, fs.mountpoint) if os.path.isabs(r.path) else r.path][r.offset :
            r.offset + r.nbytes] for r in reqs]  # fmt: skip
    with BlockdevBackend(out, device_path=fs.image, threads=4) as b:
        assert [bytes(x) for x in b.read(reqs)] == want  # both pools now running in this process
        assert forked_exit(_raw_reads_in_a_forked_child, (b, reqs, want), "its parent's read pools") == 0


def test_registry_pickling_and_errors(mapped: tuple[Any, Path, dict]) -> None:
    fs, out, content = mapped
    b = get_backend("blockdev", bmap=out, device_path=fs.image, threads=2)
    try:
        clone = pickle.loads(pickle.dumps(b))  # DataLoader workers get a copy that reopens its descriptors
        (got,) = clone.read([ReadRequest("odd4", 10, 60000)])
        assert bytes(got) == content["odd4"][10:60010]
        clone.close()
        with pytest.raises(BackendError, match="short read"):
            b.read([ReadRequest("odd1", 500, 100)])
        with pytest.raises(BackendError, match="not in block map"):
            b.read([ReadRequest(str(fs.mountpoint.parent / "x"), 0, 1)])
    finally:
        b.close()


def test_stale_and_filesystem_only_fall_back_with_one_warning(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    fs = make_loopfs("ext4", mkfs_args=("-O", "inline_data"))
    mnt: Path = fs.mountpoint
    (mnt / "tiny").write_bytes(b"inline bytes")
    with open(mnt / "unwritten", "wb") as f:
        os.posix_fallocate(f.fileno(), 0, 16384)
    (mnt / "changing").write_bytes(os.urandom(8192))
    build_bmap(mnt, tmp_path / "m.json")
    new = os.urandom(8192)
    (mnt / "changing.tmp").write_bytes(new)
    os.replace(mnt / "changing.tmp", mnt / "changing")
    with BlockdevBackend(tmp_path / "m.json", device_path=fs.image) as b:
        with pytest.warns(RuntimeWarning) as record:
            for _ in range(3):
                got = b.read(
                    [ReadRequest("tiny", 0, 12), ReadRequest("unwritten", 100, 50), ReadRequest("changing", 0, 8192)]
                )
        assert [bytes(g) for g in got] == [b"inline bytes", bytes(50), new]
        messages = sorted(str(w.message) for w in record)
        assert len(messages) == 3  # once per file, not once per read
        assert "changed since it was mapped" in messages[0] and "changing" in messages[0]
        assert "not raw-readable (inline)" in messages[1] and "not raw-readable (unwritten)" in messages[2]
    strict = BlockdevBackend(tmp_path / "m.json", device_path=fs.image, fallback=False)
    with strict, pytest.raises(BackendError, match="tiny: not raw-readable"):
        strict.read([ReadRequest("tiny", 0, 1)])


def test_lba_ranges_address_the_device(mapped: tuple[Any, Path, dict]) -> None:
    fs, out, content = mapped
    bm = BlockMap.load(out)
    lbs = bm.logical_block_size
    fd = os.open(fs.image, os.O_RDONLY)
    try:
        for key in ("d/frag0", "sparse", "odd3"):
            got = bytearray(len(content[key]))
            for r in bm.lba_ranges(key):
                run = os.pread(fd, r.nblocks * lbs, MiB + r.lba * lbs)  # whole-disk LBAs + the image offset
                got[r.file_offset : r.file_offset + r.nbytes] = run[r.skip : r.skip + r.nbytes]
            assert bytes(got) == content[key], key
    finally:
        os.close(fd)


def test_raw_device_unaligned_reads(tmp_path: Path) -> None:
    data = os.urandom(3 * 4096 + 77)
    (tmp_path / "img").write_bytes(data)
    raw = RawDevice(str(tmp_path / "img"))
    try:
        for off, n in [(0, 4096), (1, 10), (4095, 4098), (8192, 4096 + 77), (0, len(data))]:
            out = bytearray(n)
            raw.read_into(off, memoryview(out))
            assert bytes(out) == data[off : off + n]
        with pytest.raises(BackendError, match="short read"):
            raw.read_into(len(data) - 5, memoryview(bytearray(10)))
    finally:
        raw.close()


def test_check_stale_off_trusts_the_map(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    fs = make_loopfs("ext4")
    data = os.urandom(10000)
    (fs.mountpoint / "f").write_bytes(data)
    build_bmap(fs.mountpoint, tmp_path / "m.json")
    os.utime(fs.mountpoint / "f", ns=(1, 1))  # only the mtime changes: the blocks still hold the same bytes
    with pytest.warns(RuntimeWarning, match="check_stale=False: raw reads go to the extents the map names"):
        trusting = BlockdevBackend(tmp_path / "m.json", device_path=fs.image, check_stale=False)
    with trusting, warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bytes(trusting.read([ReadRequest("f", 0, 10000)])[0]) == data
    with BlockdevBackend(tmp_path / "m.json", device_path=fs.image) as b, pytest.warns(RuntimeWarning, match="mtime"):
        assert bytes(b.read([ReadRequest("f", 0, 10000)])[0]) == data


@pytest.mark.parametrize("block", ["4096", "1024"])  # 4 KiB: vectored reads in place; 1 KiB: via a bounce buffer
def test_many_small_files_coalesced_without_overrun(
    make_loopfs: Callable[..., Any], tmp_path: Path, block: str
) -> None:
    fs = make_loopfs("ext4", mkfs_args=("-b", block))
    content = {f"s{i:03d}": os.urandom(1 + (i * 977) % 9000) for i in range(200)}
    for k, v in content.items():  # written one after another: neighbours on the device
        (fs.mountpoint / k).write_bytes(v)
    build_bmap(fs.mountpoint, tmp_path / "m.json")
    keys = sorted(content)
    reqs = [ReadRequest(k, 0, len(content[k])) for k in keys]
    with BlockdevBackend(tmp_path / "m.json", device_path=fs.image, threads=4) as b:
        got = b.read(reqs)  # padded slots: whole runs land in place with one vectored read
        assert [bytes(g) for g in got] == [content[k] for k in keys]
        # caller buffers packed back to back with no padding: nothing may spill into a neighbour
        sizes = [len(content[k]) for k in keys]
        packed = np.full(sum(sizes) + 7, 0xEE, dtype=np.uint8)
        starts = np.cumsum([0, *sizes[:-1]]).tolist()
        b.read_into(reqs, [packed[st : st + n] for st, n in zip(starts, sizes)])
        assert bytes(packed[: sum(sizes)]) == b"".join(content[k] for k in keys)
        assert bytes(packed[sum(sizes) :]) == b"\xee" * 7


def test_grown_file_is_read_through_the_filesystem(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    fs = make_loopfs("ext4")
    for name in ("a", "b"):
        (fs.mountpoint / name).write_bytes(os.urandom(4096))
    build_bmap(fs.mountpoint, tmp_path / "m.json")
    grown = os.urandom(20000)
    with open(fs.mountpoint / "a", "ab") as f:  # appended in place: same inode, bigger than mapped
        f.write(grown)
    whole = (fs.mountpoint / "a").read_bytes()
    with BlockdevBackend(tmp_path / "m.json", device_path=fs.image, threads=4) as b:
        with pytest.warns(RuntimeWarning, match="size 4096 -> 24096"):
            got = b.read([ReadRequest("a", 100, 20000), ReadRequest("b", 0, 4096)])
        assert bytes(got[0]) == whole[100:20100]
        assert bytes(got[1]) == (fs.mountpoint / "b").read_bytes()
        with pytest.raises(BackendError, match="short read"):
            b.read([ReadRequest("b", 10, 4096), ReadRequest("a", 0, 1)])  # b did not grow: past its end


def _readers(out: Path, image: Path) -> list[Callable[[str, int], bytes]]:
    """The raw readers of a map: the blockdev backend (one and many requests) and BmapSource."""
    from loaders.faces.dali import BmapSource

    def one(key: str, n: int) -> bytes:
        with BlockdevBackend(out, device_path=image, threads=1) as b:
            return bytes(b.read([ReadRequest(key, 0, n)])[0])

    def batch(key: str, n: int) -> bytes:
        with BlockdevBackend(out, device_path=image, threads=4) as b:
            return bytes(b.read([ReadRequest(key, 0, n), ReadRequest(key, 0, n)])[1])

    def source(key: str, n: int) -> bytes:
        folder, _, name = key.rpartition("/")
        evict_tree(Path(BlockMap.load(out).root) / folder)  # not in memory: BmapSource reads it raw
        with BmapSource(out, batch_size=8, folder=folder.rpartition("/")[0], device_path=str(image)) as src:
            (data, _labels) = next(iter(src))
            return bytes(data[[p for p, _ in src.files].index(key.split("/", 1)[1])].tobytes())

    return [one, batch, source]


def test_defragmented_file_reads_its_current_bytes(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    import shutil
    import subprocess

    from loaders.blockmap.fiemap import fiemap

    if shutil.which("e4defrag") is None:
        pytest.skip("e4defrag missing (apt-get install e2fsprogs)")
    fs = make_loopfs("ext4", size_mb=32)
    mnt: Path = fs.mountpoint
    (mnt / "train" / "a").mkdir(parents=True)
    content = interleaved_appends(mnt, ["train/a/victim.jpg", "train/a/other.jpg"], rounds=12)
    build_bmap(mnt, tmp_path / "m.json")
    want = content["train/a/victim.jpg"]
    early = BlockdevBackend(tmp_path / "m.json", device_path=fs.image, threads=4)  # checked it before the move
    assert bytes(early.read([ReadRequest("train/a/victim.jpg", 0, len(want))])[0]) == want
    before, st0 = fiemap(mnt / "train/a/victim.jpg"), os.stat(mnt / "train/a/victim.jpg")
    subprocess.run(["e4defrag", str(mnt / "train/a/victim.jpg")], check=True, capture_output=True)
    st1 = os.stat(mnt / "train/a/victim.jpg")
    if [e[:3] for e in fiemap(mnt / "train/a/victim.jpg")] == [e[:3] for e in before]:
        pytest.skip("e4defrag left the file where it was")
    # what makes this case dangerous: nothing a stat shows changed
    assert (st1.st_size, st1.st_ino, st1.st_mtime_ns, st1.st_ctime_ns) == (
        st0.st_size,
        st0.st_ino,
        st0.st_mtime_ns,
        st0.st_ctime_ns,
    )
    fill_free_space(mnt, 0xEE)  # the blocks the map points at now hold other bytes
    with early, pytest.warns(RuntimeWarning, match="victim.jpg: changed since it was mapped .*moved"):
        assert bytes(early.read([ReadRequest("train/a/victim.jpg", 0, len(want))])[0]) == want
    for read in _readers(tmp_path / "m.json", fs.image):
        with pytest.warns(RuntimeWarning, match="victim.jpg: changed since it was mapped .*moved"):
            assert read("train/a/victim.jpg", len(want)) == want, read.__name__


def test_read_only_filesystem_is_not_rechecked_every_call(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    """Each read call opens every file again to catch moved blocks, except while the filesystem itself is
    read-only (a read-only bind mount of it does not count); the bytes are the same either way."""
    import subprocess

    fs = make_loopfs("ext4")
    mnt: Path = fs.mountpoint
    content = {name: os.urandom(9000 + i) for i, name in enumerate(("a", "b"))}
    for name, data in content.items():
        (mnt / name).write_bytes(data)
    build_bmap(mnt, tmp_path / "m.json")
    bind = tmp_path / "bind"
    bind.mkdir()
    checked: list[str] = []

    def read(b: BlockdevBackend) -> list[str]:
        checked.clear()
        got = b.read([ReadRequest(k, 0, len(v)) for k, v in content.items()])
        assert [bytes(g) for g in got] == list(content.values())
        return sorted(set(checked))  # a file read on the slow path (1 KiB blocks here) is checked twice

    with BlockdevBackend(tmp_path / "m.json", threads=4) as b:
        b.guard._clock = None  # as on a device whose writes cannot be counted (the next test has the counted case)
        read(b)  # the first check of each file
        compare = b.guard._compare
        b.guard._compare = lambda key, *a: checked.append(key) or compare(key, *a)  # type: ignore[method-assign]
        assert read(b) == ["a", "b"]
        subprocess.run(["mount", "--bind", str(mnt), str(bind)], check=True)
        try:
            subprocess.run(["mount", "-o", "remount,bind,ro", str(bind)], check=True)
            assert read(b) == ["a", "b"]  # the filesystem is still writable through mnt
        finally:
            subprocess.run(["umount", str(bind)], check=True)
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        assert read(b) == []
        subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=True)
        assert read(b) == ["a", "b"]


def _quiet(clock: WriteClock) -> tuple[int, ...]:
    """Sync, then wait until the device's write counters stand still (ext4's journal commits, lazy init)."""
    os.sync()
    last, deadline = clock.now(), time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.2)
        now = clock.now()
        if now is not None and now == last:
            return now
        last = now
    pytest.skip(f"the loop device kept being written for 10 s (its counters: {last})")


def test_files_are_rechecked_by_lstat_while_nothing_is_written(
    make_loopfs: Callable[..., Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A later read call opens and FIEMAPs a file again only after a write reached the device since its last
    check (a move leaves its old blocks as they were until then); in between one lstat stands for it, and a
    file rewritten in place that is not yet written back is still caught by its times."""
    # the files are made just now: without this, a ctime under RECENT_CTIME_S old gets the full check every call
    monkeypatch.setattr("loaders.backends.mapped.RECENT_CTIME_S", 0.0)
    fs = make_loopfs("ext4", mkfs_args=("-E", "lazy_itable_init=0,lazy_journal_init=0"))
    mnt: Path = fs.mountpoint
    content = {name: os.urandom(9000 + i) for i, name in enumerate(("a", "b"))}
    for name, data in content.items():
        (mnt / name).write_bytes(data)
    build_bmap(mnt, tmp_path / "m.json")
    assert WriteClock(str(mnt)).now() is not None, "a loop device counts its writes in sysfs"
    assert WriteClock("/proc").now() is None  # no block device behind it: every call checks every file
    checked: list[str] = []

    def read(b: BlockdevBackend) -> list[str]:
        checked.clear()
        got = b.read([ReadRequest(k, 0, len(v)) for k, v in content.items()])
        assert [bytes(g) for g in got] == list(content.values())
        return sorted(set(checked))

    with BlockdevBackend(tmp_path / "m.json", threads=4) as b:
        clock = b.guard._clock
        assert clock is not None
        _quiet(clock)
        compare = b.guard._compare
        b.guard._compare = lambda key, *a: checked.append(key) or compare(key, *a)  # type: ignore[method-assign]
        assert read(b) == ["a", "b"]  # the first check of each file
        assert read(b) == []  # nothing written since: one lstat each
        os.sync()
        assert read(b) == []  # a cache flush (what sync sends with nothing dirty) writes no sector
        (mnt / "elsewhere").write_bytes(os.urandom(50000))
        _quiet(clock)
        assert read(b) == ["a", "b"]  # a write reached the device: every file is checked in full again
        assert read(b) == []
        content["a"] = os.urandom(9000)
        with open(mnt / "a", "r+b") as f:  # same inode and size, its new bytes only in the page cache
            f.write(content["a"])
        still = clock.now()
        with pytest.warns(RuntimeWarning, match="a: changed since it was mapped"):
            again = read(b)
        if clock.now() == still:  # nothing reached the device: the lstat alone sent it to its full check
            assert again == ["a"]


def test_cached_says_whether_a_raw_read_would_wait(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    """Through the loop image's page cache: True once the file's blocks are resident, False after they are
    dropped; O_DIRECT reads of the device always wait (BmapSource reads ahead only batches that would)."""
    from loaders.backends.base import PageCacheProbe

    if not PageCacheProbe().available:
        pytest.skip("no cachestat(2) here: residency cannot be told")
    fs = make_loopfs("ext4")
    data = os.urandom(40000)
    (fs.mountpoint / "a").write_bytes(data)
    build_bmap(fs.mountpoint, tmp_path / "m.json")
    with BlockdevBackend(tmp_path / "m.json", threads=4) as b:
        if b._raw.direct:
            pytest.skip("this loop device reads its image with direct I/O")
        assert bytes(b.read([ReadRequest("a", 0, len(data))])[0]) == data
        assert b.cached("a")
        os.sync()  # the loop driver's writes of the image: DONTNEED leaves dirty pages where they are
        fd = os.open(fs.image, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        assert not b.cached("a")
    with BlockdevBackend(tmp_path / "m.json", device_path=fs.device, threads=4) as direct:
        assert direct._raw.direct and not direct.cached("a")


def _edited_map(out: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    from loaders.blockmap.bmap import encode_document

    doc = json.loads(out.read_bytes())
    edit(doc)
    edited = out.with_name("edited.json")
    edited.write_bytes(encode_document(doc))  # checksum recomputed: the map loads as valid
    return edited


def test_edited_map_never_reads_another_files_blocks(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    fs = make_loopfs("ext4", size_mb=32, offset=MiB)
    mnt: Path = fs.mountpoint
    (mnt / "train" / "a").mkdir(parents=True)
    secret, mine = os.urandom(3 * 4096), os.urandom(3 * 4096)
    (mnt / "train/a/secret.jpg").write_bytes(secret)
    os.chmod(mnt / "train/a/secret.jpg", 0o600)
    (mnt / "train/a/mine.jpg").write_bytes(mine)
    build_bmap(mnt, tmp_path / "m.json")
    files = json.loads((tmp_path / "m.json").read_bytes())["files"]
    s_ph, m_ph = files["train/a/secret.jpg"]["extents"][0][1], files["train/a/mine.jpg"]["extents"][0][1]

    def steal(doc: dict[str, Any]) -> None:  # mine's extents point at secret's blocks
        doc["files"]["train/a/mine.jpg"]["extents"] = doc["files"]["train/a/secret.jpg"]["extents"]

    def shift(doc: dict[str, Any]) -> None:  # the image offset moved so that mine's extent lands on secret's
        doc["loop"]["offset"] += s_ph - m_ph

    def beyond(doc: dict[str, Any]) -> None:  # an extent past the end of the filesystem's device
        doc["files"]["train/a/mine.jpg"]["extents"][0][1] = 1 << 40

    for edit in (steal, shift, beyond):
        edited = _edited_map(tmp_path / "m.json", edit)
        for read in _readers(edited, fs.image):
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                try:
                    got = read("train/a/mine.jpg", len(mine))
                except BackendError as exc:  # refused is fine, wrong bytes are not
                    assert "mine.jpg" in str(exc) or str(fs.image) in str(exc), exc
                    continue
            assert got == mine, (edit.__name__, read.__name__, got == secret[: len(got)])


def test_raw_open_errors_tell_root_nothing_about_becoming_root(tmp_path: Path) -> None:
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.skip("needs root (and setpriv) to try both sides")
    with pytest.raises(BackendError) as err:
        RawDevice(str(tmp_path / "no-such-image")).fd()
    assert "no-such-image" in str(err.value) and "root or the disk group" not in str(err.value)
    (tmp_path / "img").write_bytes(bytes(4096))
    os.chmod(tmp_path / "img", 0o600)
    os.chmod(tmp_path, 0o755)
    code = f"from loaders.backends.blockdev import RawDevice\nRawDevice({str(tmp_path / 'img')!r}).fd()"
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code]
    proc = subprocess.run(as_nobody, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert proc.returncode == 1 and "root or the disk group" in proc.stderr, proc.stderr
