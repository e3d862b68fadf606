"""Benchmark block maps: mapping rate against `filefrag`, and cold raw range reads against one large O_DIRECT read.

    python -m workflows.bench_bmap --files 100000 --workers 8

Needs root (it makes and loop-mounts an ext4 image with N small files under --tmp, and removes it after).
Every ratio compares two things measured in the same run on the same files:

- mapping: `prep.bmap.build_bmap` (1 worker and W workers) vs `filefrag -s -e` (the same FIEMAP_FLAG_SYNC
  and extent listing) over the same files, many paths per invocation, as one process and as W processes;
- raw reads (cold: before each run the image's pages are dropped with fadvise DONTNEED, and all clean
  pages with drop_caches as root): every mapped file read whole through `BlockdevBackend` from the image
  file, in a first epoch (a fresh backend: one stat per file checks the map is not stale), a later epoch of
  the same backend (verdicts cached; data cold again) and with check_stale=False; vs as many bytes read with
  O_DIRECT from one contiguous region of the image where the files' data lies, T requests in flight: in
  1 MiB requests (the device's ceiling), and in requests of the files' sizes (the same request count).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FILEFRAG_BATCH = 2000  # paths per filefrag invocation: process start-up is amortised, as a user would batch


@dataclass
class Row:
    """One line of the result table."""

    what: str
    seconds: float
    count: int  # files or requests
    nbytes: int
    peer: str = ""
    ratio: float | None = None

    def rate(self) -> str:
        per_s = self.count / self.seconds if self.seconds > 0 else 0.0
        gbs = self.nbytes / self.seconds / 1e9 if self.seconds > 0 and self.nbytes else 0.0
        return f"{per_s:>12,.0f}/s" + (f" {gbs:7.2f} GB/s" if gbs else " " * 13)


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


@contextmanager
def loop_ext4(tmp: Path, size_mb: int, inodes: int) -> Iterator[tuple[Path, Path, str]]:
    """A fresh ext4 image under `tmp`, loop-mounted; yields (image, mountpoint, device); always cleaned up."""
    if os.geteuid() != 0:
        raise SystemExit("bench_bmap needs root: it loop-mounts an ext4 image (run it as root or in CI)")
    image, mnt = tmp / "bench.img", tmp / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    device = _run("losetup", "--find", "--show", str(image))
    try:
        _run("mkfs.ext4", "-q", "-F", "-N", str(inodes), device)
        _run("mount", device, str(mnt))
        try:
            yield image, mnt, device
        finally:
            subprocess.run(["umount", str(mnt)], check=False)
    finally:
        subprocess.run(["losetup", "-d", device], check=False)


def make_files(mnt: Path, n: int, mean_size: int, seed: int = 0) -> list[str]:
    """N files of random sizes (1 byte .. 2x mean) in folders of 1000, like a class-folder image tree."""
    rng = random.Random(seed)
    payload = os.urandom(2 * mean_size)
    keys = []
    for i in range(n):
        d = mnt / f"c{i // 1000:04d}"
        if i % 1000 == 0:
            d.mkdir()
        key = f"{d.name}/f{i:07d}.bin"
        (mnt / key).write_bytes(payload[: rng.randint(1, 2 * mean_size)])
        keys.append(key)
    os.sync()
    return keys


def drop_caches(image: Path) -> None:
    """Evict the image's pages (and, as root, every clean page) so the next read is cold."""
    os.sync()
    fd = os.open(image, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):  # not root or not permitted: fadvise above still evicted the image
        Path("/proc/sys/vm/drop_caches").write_text("3\n")


def time_filefrag(mnt: Path, keys: Sequence[str], procs: int) -> float:
    """Seconds for `filefrag -s -e` over every file, FILEFRAG_BATCH paths per call, `procs` calls at a time."""
    batches = [[str(mnt / k) for k in keys[i : i + FILEFRAG_BATCH]] for i in range(0, len(keys), FILEFRAG_BATCH)]

    def one(paths: list[str]) -> None:
        subprocess.run(["filefrag", "-s", "-e", *paths], check=True, stdout=subprocess.DEVNULL)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(procs) as pool:
        list(pool.map(one, batches))
    return time.perf_counter() - t0


def bench_mapping(mnt: Path, keys: Sequence[str], workers: int, out: Path, repeat: int = 3) -> list[Row]:
    """Mapping rate of build_bmap (1 and W workers, including writing the map) vs filefrag (1 and W processes),
    metadata warm for all; each the best of `repeat` runs, interleaved so that load spikes hit all alike."""
    from prep.bmap import build_bmap

    def bmap_seconds(w: int) -> float:
        s = build_bmap(mnt, out, workers=w)
        assert s.files == len(keys), f"mapped {s.files} of {len(keys)} files"
        return s.seconds

    time_filefrag(mnt, keys, workers)  # warm the inode and extent caches for everyone
    times: dict[str, list[float]] = {}
    for _ in range(repeat):
        for name, fn in (
            ("ff1", lambda: time_filefrag(mnt, keys, 1)),
            ("ffw", lambda: time_filefrag(mnt, keys, workers)),
            ("b1", lambda: bmap_seconds(1)),
            ("bw", lambda: bmap_seconds(workers)),
        ):
            times.setdefault(name, []).append(fn())
    ff1, ffw, b1, bw = (min(times[k]) for k in ("ff1", "ffw", "b1", "bw"))
    n = len(keys)
    return [
        Row("filefrag -s -e, 1 process", ff1, n, 0),
        Row(f"filefrag -s -e, {workers} processes", ffw, n, 0),
        Row("build_bmap, 1 worker(s)", b1, n, 0, "filefrag 1 process", ff1 / b1),
        Row(f"build_bmap, {workers} workers", bw, n, 0, "filefrag 1 process", ff1 / bw),
        Row(f"build_bmap, {workers} workers", bw, n, 0, f"filefrag {workers} procs", ffw / bw),
    ]


def _direct_reads(image: Path, offsets: Sequence[int], sizes: Sequence[int], threads: int) -> float:
    """Seconds to read (offset, size) pairs with O_DIRECT into aligned buffers, `threads` in flight."""
    from loaders.backends.base import aligned_empty
    from loaders.format import align_up

    fd = os.open(image, os.O_RDONLY | os.O_DIRECT)
    try:

        def one(i: int) -> None:
            buf = aligned_empty(align_up(sizes[i]))
            os.preadv(fd, [buf.data], offsets[i])

        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, range(len(offsets)), chunksize=64))
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def bench_reads(image: Path, bmap_path: Path, threads: int, batch: int = 1024, repeat: int = 3) -> list[Row]:
    """Cold raw reads of every mapped file through BlockdevBackend vs one contiguous O_DIRECT region; each the
    best of `repeat` cold runs."""
    from loaders.backends import ReadRequest
    from loaders.backends.blockdev import BlockdevBackend
    from loaders.bmap import BlockMap
    from loaders.format import ALIGN, align_up

    bm = BlockMap.load(bmap_path)
    reqs = [ReadRequest(k, 0, bm.files[k]["size"]) for k in bm.files if bm.files[k]["size"]]
    total = sum(r.nbytes for r in reqs)
    sizes = [r.nbytes for r in reqs]
    rows = []

    def backend_seconds(check: bool) -> tuple[float, float]:
        """Seconds for a first epoch (fresh backend: the freshness checks run) and a later one (verdicts
        cached for the backend's life), each with the page cache dropped first."""
        epochs = []
        with BlockdevBackend(bm, device_path=image, threads=threads, check_stale=check) as b:
            for _ in range(2):
                drop_caches(image)
                t0 = time.perf_counter()
                for i in range(0, len(reqs), batch):
                    b.read(reqs[i : i + batch])
                epochs.append(time.perf_counter() - t0)
        return epochs[0], epochs[1]

    def direct_seconds(offsets: Sequence[int], lengths: Sequence[int]) -> float:
        drop_caches(image)
        return _direct_reads(image, offsets, lengths, threads)

    # the same reads at the files' own device offsets (their first extent: these small files have one), no map
    mapped = [bm.source(image).base + bm.files[r.path]["extents"][0][1] for r in reqs]
    # peers: as many bytes as the files hold, as one contiguous region where the files' data lies (not the
    # image's start: inode tables there may be holes of the sparse image, which read as free zeros)
    big = 1 << 20
    lo = min(mapped) - min(mapped) % ALIGN
    lo = max(0, min(lo, image.stat().st_size - align_up(total, big)))
    big_offsets = list(range(lo, lo + align_up(total, big), big))
    same_offsets = [lo + int(o) for o in np.cumsum([0] + [align_up(s) for s in sizes[:-1]])]
    times: dict[str, list[float]] = {}
    for _ in range(repeat):
        for name, fn in (
            ("check", lambda: backend_seconds(True)),
            ("nocheck", lambda: backend_seconds(False)),
            ("big", lambda: direct_seconds(big_offsets, [big] * len(big_offsets))),
            ("same", lambda: direct_seconds(same_offsets, sizes)),
            ("at", lambda: direct_seconds(mapped, sizes)),
        ):
            got = fn()
            if isinstance(got, tuple):
                times.setdefault(name + " first", []).append(got[0])
                times.setdefault(name + " later", []).append(got[1])
            else:
                times.setdefault(name, []).append(got)
    t_big, t_same, t_at = min(times["big"]), min(times["same"]), min(times["at"])
    n = len(reqs)
    rows.append(Row(f"O_DIRECT 1 MiB requests, {threads} in flight", t_big, len(big_offsets), total))
    rows.append(Row(f"O_DIRECT file-sized requests, {threads} in flight", t_same, n, total))
    rows.append(Row(f"O_DIRECT at the files' offsets, {threads} in flight", t_at, n, total))
    for name, label in (
        ("check first", "first epoch (stat check)"),
        ("check later", "later epoch (checked once)"),
        ("nocheck first", "check_stale=False"),
    ):
        t = min(times[name])
        what = f"BlockdevBackend {threads} thr, {label}"
        rows.append(Row(what, t, n, total, "1 MiB O_DIRECT", t_big / t))
        rows.append(Row(what, t, n, total, "same-size O_DIRECT", t_same / t))
        rows.append(Row(what, t, n, total, "O_DIRECT at offsets", t_at / t))
    return rows


def print_table(rows: Sequence[Row]) -> None:
    """The result table: rate per row, and the ratio against its peer (>1: faster than the peer)."""
    print(f"{'what':<50} {'seconds':>8} {'rate':>28}  vs peer")
    for r in rows:
        vs = f"{r.ratio:5.2f}x {r.peer}" if r.ratio is not None else ""
        print(f"{r.what:<50} {r.seconds:8.3f} {r.rate():>28}  {vs}")


def run(
    files: int,
    workers: int,
    threads: int = 16,
    mean_size: int = 16384,
    tmp: Path | None = None,
    batch: int = 1024,
    repeat: int = 3,
) -> list[Row]:
    """Make the image, run both benchmarks, clean up; returns the table rows."""
    base = Path(tempfile.mkdtemp(prefix="bench_bmap-", dir=tmp))
    try:
        size_mb = 64 + files * (mean_size + 4096 + 512) * 3 // 2 // (1 << 20)
        with loop_ext4(base, size_mb, files + 1024) as (image, mnt, _device):
            keys = make_files(mnt, files, mean_size)
            rows = bench_mapping(mnt, keys, workers, base / "bmap.json", repeat)
            rows += bench_reads(image, base / "bmap.json", threads, batch, repeat)
        return rows
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> None:
    """Command-line entry."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=100_000, help="number of small files (default 100000)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 4, help="mapping workers / filefrag procs")
    parser.add_argument("--threads", type=int, default=16, help="raw read requests in flight (default 16)")
    parser.add_argument("--mean-size", type=int, default=16384, help="mean file size in bytes (default 16 KiB)")
    parser.add_argument("--tmp", type=Path, default=None, help="where the image goes (default: the system temp)")
    parser.add_argument("--batch", type=int, default=1024, help="files per BlockdevBackend.read call (default 1024)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measurement; the best is kept")
    args = parser.parse_args(argv)
    load = os.getloadavg()
    rows = run(args.files, args.workers, args.threads, args.mean_size, args.tmp, args.batch, args.repeat)
    print(
        f"\nbench_bmap: {args.files} files (mean {args.mean_size} B) on a loop-mounted ext4 image; "
        f"raw reads in batches of {args.batch} files, from the image file; best of {args.repeat} runs"
    )
    print(
        f"{os.cpu_count()} CPUs; load average (1 min) {load[0]:.2f} before, {os.getloadavg()[0]:.2f} after "
        "(other work on the machine shows up in every row, peers included)"
    )
    print_table(rows)


if __name__ == "__main__":
    main()
