"""DirectBackend specifics: chunking, page-cache bypass, fallback where O_DIRECT is refused, loop mounts."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders.backends import ReadRequest, aligned_empty, get_backend
from loaders.backends.direct import DirectBackend, PageCacheProbe
from loaders.errors import BackendError

SIZE = 3 * (1 << 20) + 5 * 4096 + 77  # several default chunks, an unaligned tail


@pytest.fixture(scope="module")
def big_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, bytes]:
    payload = np.random.default_rng(11).integers(0, 256, SIZE, dtype=np.uint8).tobytes()
    path = tmp_path_factory.mktemp("direct") / "big.bin"
    path.write_bytes(payload)
    return path, payload


def test_registered_and_reads_with_o_direct(big_file: tuple[Path, bytes]) -> None:
    path, payload = big_file
    with get_backend("direct", threads=4) as b:
        assert isinstance(b, DirectBackend)
        (buf,) = b.read([ReadRequest(str(path), 0, SIZE)])
        assert bytes(buf) == payload
        assert buf.ctypes.data % 4096 == 0  # an aligned request reads straight into an aligned buffer
        fd, direct = b._fd(str(path))
        assert direct and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT


@settings(max_examples=60, deadline=None)
@given(
    offset=st.integers(0, SIZE - 1),
    length=st.integers(1, 300_000),
    chunk=st.sampled_from([4096, 3 * 4096, 1 << 20]),
    into=st.sampled_from(["new", "aligned", "misaligned"]),
    page_cache=st.booleans(),
)
def test_any_range_any_chunk(
    big_file: tuple[Path, bytes], offset: int, length: int, chunk: int, into: str, page_cache: bool
) -> None:
    path, payload = big_file
    nbytes = min(length, SIZE - offset)
    req = ReadRequest(str(path), offset, nbytes)
    with DirectBackend(threads=4, chunk=chunk, page_cache=page_cache) as b:
        if into == "new":
            (out,) = b.read([req])
        else:  # caller buffers of exactly nbytes: aligned (bulk read in place, tail bounced) or not
            out = aligned_empty(nbytes + 4096)[:nbytes] if into == "aligned" else np.zeros(nbytes + 3, np.uint8)[3:]
            out[:] = 7
            b.read_into([req], [out])
    assert bytes(out) == payload[offset : offset + nbytes]


def test_aligned_caller_buffer_is_filled_in_place(big_file: tuple[Path, bytes]) -> None:
    path, payload = big_file
    big = aligned_empty(3 * 4096)
    big[:] = 9
    out = big[: 2 * 4096 + 100]  # aligned start, unaligned length: only the last block goes through a bounce
    with DirectBackend(page_cache=False) as b:
        jobs = b._plan(ReadRequest(str(path), 4096, len(out)), out)
        assert [j.target.ctypes.data == out.ctypes.data for j in jobs] == [True, False]
        b.read_into([ReadRequest(str(path), 4096, len(out))], [out])
    assert bytes(out) == payload[4096 : 4096 + len(out)] and set(big[len(out) :]) == {9}  # nothing past it


def test_one_large_read_is_split_into_many_requests(big_file: tuple[Path, bytes]) -> None:
    path, payload = big_file
    b = DirectBackend(threads=8, chunk=64 * 1024, page_cache=False)
    seen: list[int] = []
    piece = b._piece

    def spy(p: str, view: memoryview, offset: int, warm: bool = False) -> int:
        seen.append(offset)
        return piece(p, view, offset, warm)

    b._piece = spy  # type: ignore[method-assign]
    with b:
        (buf,) = b.read([ReadRequest(str(path), 0, SIZE)])
    assert bytes(buf) == payload
    assert sorted(seen) == list(range(0, SIZE, 64 * 1024))


def test_bad_options_and_buffers(big_file: tuple[Path, bytes]) -> None:
    path, _ = big_file
    with pytest.raises(BackendError, match="multiple of 4096"):
        DirectBackend(chunk=1000)
    with DirectBackend() as b:
        with pytest.raises(BackendError, match="smaller than the read"):
            b.read_into([ReadRequest(str(path), 0, 100)], [np.zeros(50, np.uint8)])
        with pytest.raises(BackendError, match="C-contiguous"):
            b.read_into([ReadRequest(str(path), 0, 100)], [np.zeros(400, np.uint8)[::2]])


def test_short_read_past_end_names_file(big_file: tuple[Path, bytes]) -> None:
    path, _ = big_file
    with DirectBackend(chunk=4096) as b, pytest.raises(BackendError, match=rf"{path.name}: short read .*\(77 of 100"):
        b.read([ReadRequest(str(path), SIZE - 77, 100)])


def test_proc_refuses_o_direct_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    expected = Path("/proc/version").read_bytes()[:20]
    with caplog.at_level(logging.WARNING, "loaders.backends.direct"), DirectBackend() as b:
        for _ in range(3):
            (buf,) = b.read([ReadRequest("/proc/version", 0, 20)])
            assert bytes(buf) == expected
    warnings = [r for r in caplog.records if "O_DIRECT refused" in r.getMessage()]
    assert len(warnings) == 1 and "/proc/version" in warnings[0].getMessage()


@pytest.fixture
def ramfs(tmp_path: Path) -> Iterator[Path]:
    """A ramfs mount: a real filesystem that refuses O_DIRECT at open (EINVAL)."""
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting ramfs needs root")
    res = subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)], capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount ramfs: {res.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_ramfs_falls_back_to_buffered(ramfs: Path, big_file: tuple[Path, bytes]) -> None:
    _, payload = big_file
    path = ramfs / "x.bin"
    path.write_bytes(payload[:20_000])
    with DirectBackend(chunk=4096) as b:
        bufs = b.read([ReadRequest(str(path), 0, 20_000), ReadRequest(str(path), 4097, 9000)])
        assert str(path) in b._fallback
    assert bytes(bufs[0]) == payload[:20_000] and bytes(bufs[1]) == payload[4097:13097]


@pytest.mark.loopdev
@pytest.mark.parametrize(
    ("fstype", "mkfs_args"),
    [("ext4", ("-b", "1024")), ("ext4", ()), ("xfs", ()), ("xfs", ("-b", "size=1024"))],
    ids=["ext4-1k", "ext4-4k", "xfs-4k", "xfs-1k"],
)
def test_loop_mounts(make_loopfs: Callable[..., object], fstype: str, mkfs_args: tuple[str, ...]) -> None:
    fs = make_loopfs(fstype, size_mb=16, mkfs_args=mkfs_args)
    payload = np.random.default_rng(3).integers(0, 256, 700_001, dtype=np.uint8).tobytes()
    path = Path(fs.mountpoint) / "vol.bin"  # type: ignore[attr-defined]
    path.write_bytes(payload)
    os.sync()
    reqs = [
        ReadRequest(str(path), 0, len(payload)),
        ReadRequest(str(path), 1023, 5000),
        ReadRequest(str(path), 699_000, 1001),
    ]
    with DirectBackend(chunk=64 * 1024) as b:
        for r, buf in zip(reqs, b.read(reqs)):
            assert bytes(buf) == payload[r.offset : r.offset + r.nbytes]
        assert not b._fallback


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def test_o_direct_bypasses_and_warm_data_come_from_the_cache(tmp_path: Path) -> None:
    probe = PageCacheProbe()
    path = tmp_path / "c.bin"
    payload = np.random.default_rng(8).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()
    path.write_bytes(payload)
    _evict(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        if not probe.available or probe.resident(fd, 0, 4096):
            pytest.skip("cachestat(2) unavailable or eviction not honoured here")
        with DirectBackend(chunk=64 * 1024) as b:
            seen: list[tuple[int, bool]] = []
            piece = b._piece
            b._piece = lambda p, v, o, w=False: seen.append((o, w)) or piece(p, v, o, w)  # type: ignore[method-assign]
            b.read([ReadRequest(str(path), 0, 1 << 20)])
            assert not probe.resident(fd, 0, 4096) and not any(w for _, w in seen)  # O_DIRECT left the cache alone
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # no readahead past the half we read
            os.pread(fd, 1 << 19, 0)  # first half warm
            real = b._buffered.get
            buffered: list[str] = []
            b._buffered.get = lambda p: buffered.append(p) or real(p)  # type: ignore[method-assign]
            (half,) = b.read([ReadRequest(str(path), 0, 1 << 20)])
            assert len(buffered) == 8  # the eight cached 64 KiB chunks were copied, the rest read O_DIRECT
            path.read_bytes()  # now all warm: one warm request, read buffered into the caller's buffer
            seen.clear()
            out = np.zeros((1 << 20) + 1, np.uint8)[1:]
            b.read_into([ReadRequest(str(path), 0, 1 << 20)], [out])
            assert seen == [(0, True)]
        assert bytes(half) == payload and bytes(out) == payload
    finally:
        os.close(fd)
