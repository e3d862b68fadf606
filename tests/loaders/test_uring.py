"""loaders.reading.uring: whole files through io_uring, exact bytes, errors named, nothing left open, merged
requests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from loaders.reading import uring

needs_uring = pytest.mark.skipif(
    not uring.available(), reason="no io_uring here (old kernel, seccomp or kernel.io_uring_disabled)"
)


def _files(folder: Path, sizes: list[int], seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i, n in enumerate(sizes):
        path = folder / f"f{i:04d}.bin"
        path.write_bytes(rng.integers(0, 256, n, dtype=np.uint8).tobytes())
        out.append(str(path))
    return out


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@needs_uring
def test_batches_in_flight_give_each_file_exactly(tmp_path: Path) -> None:
    """Two batches submitted before either is finished, finished in the other order; empty and large files;
    more files than the ring holds (submitted in slices)."""
    paths = _files(tmp_path, [0, 1, 4095, 4096, 4097, 300_000] + [17_000] * 150)
    empty = uring.BatchReader()
    assert empty.finish(empty.start([])) == []
    empty.close()
    fds = _open_fds()
    reader = uring.BatchReader(entries=32)
    first, second = reader.start(paths[:6]), reader.start(paths[6:])
    got = reader.finish(second)
    got = reader.finish(first) + got
    assert [a.tobytes() for a in got] == [Path(p).read_bytes() for p in paths]
    assert all(a.dtype == np.uint8 and a.ndim == 1 for a in got)
    reader.close()
    assert _open_fds() == fds


@needs_uring
def test_a_missing_file_is_named_and_nothing_stays_open(tmp_path: Path) -> None:
    paths = _files(tmp_path, [100, 200])
    fds = _open_fds()
    with pytest.raises(FileNotFoundError, match="nope.bin"):
        uring.BatchReader().start([paths[0], str(tmp_path / "nope.bin"), paths[1]])
    assert _open_fds() == fds


@needs_uring
def test_short_and_failed_reads(tmp_path: Path) -> None:
    """A read the kernel returned short is finished with plain reads (a file that shrank stops at its end);
    a failed read raises OSError naming its file; the batch's files are closed either way."""
    paths = _files(tmp_path, [10_000, 20_000])
    reader = uring.BatchReader()
    batch = reader.start(paths)
    reader.finish(batch)  # the real reads; now replay their ending with other results
    for results, want in (([100, 20_000], [10_000, 20_000]), ([10_000, 0], [10_000, 0])):
        again = reader.start(paths)
        reader._ring.wait(again.tags)  # type: ignore[union-attr]
        reader._open.remove(again)
        assert [len(a) for a in again.arrays(results)] == want and again.fds == []
    again = reader.start(paths)
    reader._ring.wait(again.tags)  # type: ignore[union-attr]
    reader._open.remove(again)
    with pytest.raises(OSError, match="f0001.bin"):
        again.arrays([10_000, -5])
    assert again.fds == []
    with open(paths[0], "r+b") as f:  # shrinks between the open and the read: what it holds
        batch = reader.start(paths[:1])
        f.truncate(0)
    assert len(reader.finish(batch)[0]) in (0, 10_000)  # the read may have run before the truncate
    reader.close()


@needs_uring
def test_close_waits_for_reads_in_flight(tmp_path: Path) -> None:
    paths = _files(tmp_path, [50_000] * 40)
    fds = _open_fds()
    reader = uring.BatchReader()
    reader.start(paths)
    reader.start(paths[:5])
    reader.close()
    assert _open_fds() == fds
    assert [a.tobytes() for a in reader.finish(reader.start(paths[:2]))] == [Path(p).read_bytes() for p in paths[:2]]
    reader.close()


@needs_uring
def test_a_forked_child_reads_through_a_ring_of_its_own(tmp_path: Path) -> None:
    paths = _files(tmp_path, [3000] * 8)
    reader = uring.BatchReader()
    pending = reader.start(paths[:4])
    pid = os.fork()
    if pid == 0:  # the child: the parent's batch is not its own, its reads work
        code = 0
        try:
            with pytest.raises(RuntimeError, match="another process"):
                reader.finish(pending)
            got = reader.finish(reader.start(paths[4:]))
            code = 0 if [a.tobytes() for a in got] == [Path(p).read_bytes() for p in paths[4:]] else 3
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert [a.tobytes() for a in reader.finish(pending)] == [Path(p).read_bytes() for p in paths[:4]]
    reader.close()


def test_blockprep_io_uring_0_turns_it_off() -> None:
    code = "from loaders.reading import uring; print(uring.available())"
    env = {**os.environ, uring.ENV: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.loopdev
@needs_uring
def test_adjacent_cold_files_reach_the_device_as_merged_requests(make_loopfs: Callable[..., object]) -> None:
    """The point of submitting a batch at once: 64 cold files laid out one after another reach the loop
    device in far fewer requests than one read a file does (counted in the device's own statistics)."""
    fs = make_loopfs("ext4", mkfs_args=("-b", "4096"))
    folder = Path(fs.mountpoint) / "files"  # type: ignore[attr-defined]
    paths = _files(folder, [16_384] * 64)
    os.sync()
    stat = Path(f"/sys/block/{Path(fs.device).name}/stat")  # type: ignore[attr-defined]

    def requests(read: Callable[[list[str]], object]) -> int:
        for p in paths:
            fd = os.open(p, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
        before = int(stat.read_text().split()[0])
        read(paths)
        return int(stat.read_text().split()[0]) - before

    reader = uring.BatchReader()
    merged = requests(lambda ps: reader.finish(reader.start(ps)))
    reader.close()
    one_by_one = requests(lambda ps: [Path(p).read_bytes() for p in ps])
    assert one_by_one >= 48, f"the files were not cold: {one_by_one} device reads for 64 files"
    assert merged * 4 <= one_by_one, f"io_uring: {merged} device reads, one read a file: {one_by_one}"


@needs_uring
def test_known_sizes_open_through_the_ring_and_files_that_changed_are_read_as_they_are(tmp_path: Path) -> None:
    """With the sizes of an earlier read the opens go through the ring; a file that grew since is read again
    whole, one that shrank gives what it holds, a missing one is named and nothing stays open."""
    paths = _files(tmp_path, [5000, 6000, 7000, 0])
    reader = uring.BatchReader()
    sizes = np.array([len(a) for a in reader.finish(reader.start(paths))])
    assert sizes.tolist() == [5000, 6000, 7000, 0]
    with open(paths[0], "ab") as f:
        f.write(b"x" * 4000)  # grew
    with open(paths[1], "r+b") as f:
        f.truncate(100)  # shrank
    got = reader.finish(reader.start(paths, sizes))
    assert [a.tobytes() for a in got] == [Path(p).read_bytes() for p in paths]
    fds = _open_fds()
    with pytest.raises(FileNotFoundError, match="gone.bin"):
        reader.start([paths[2], str(tmp_path / "gone.bin")], sizes[2:4])
    assert _open_fds() == fds
    reader.close()
