"""`bmap`: mapping rate against `filefrag`, and cold raw range reads against O_DIRECT; `bmap-scale`: the
`prep bmap` command over a big tree (default 1,000,000 files): wall time, files/s and peak memory.

    python -m workflows.benchmark bmap --files 100000 --workers 8
    python -m workflows.benchmark bmap-scale --files 1000000 --workers 16

Needs root: it makes and loop-mounts an ext4 image with N small files (under --tmp), removed after. Every
ratio compares two things measured in the same run on the same files (filefrag: `-s -e`, the same
FIEMAP_FLAG_SYNC and extent listing, many paths per invocation). Raw reads: every mapped file read whole
through `BlockdevBackend` from the image (a first epoch: fresh backend, one stat per file; a later epoch:
verdicts cached; check_stale=False) against as many bytes read with O_DIRECT from one contiguous region of
the image, 1 MiB requests and file-sized requests, and at the files' own offsets.
"""

from __future__ import annotations

import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from workflows.bench import ceilings, scenario
from workflows.bench.core import Options, Result, Rows, Unavailable, evict

FILEFRAG_BATCH = 2000  # paths per filefrag invocation: process start-up is amortised, as a user would batch
FILEFRAG_1 = "filefrag -s -e, 1 process"


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


@contextmanager
def loop_ext4(tmp: Path, size_mb: int, inodes: int) -> Iterator[tuple[Path, Path]]:
    """A fresh ext4 image under `tmp`, loop-mounted; yields (image, mountpoint); always cleaned up."""
    if os.geteuid() != 0 or not shutil.which("mkfs.ext4") or not Path("/dev/loop-control").exists():
        raise Unavailable("needs root, mkfs.ext4 and loop devices: it loop-mounts an ext4 image")
    image, mnt = tmp / "bench.img", tmp / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_mb << 20)
    device = _run("losetup", "--find", "--show", str(image))
    try:
        _run("mkfs.ext4", "-q", "-F", "-N", str(inodes), device)
        _run("mount", device, str(mnt))
        try:
            yield image, mnt
        finally:
            subprocess.run(["umount", str(mnt)], check=False)
    finally:
        subprocess.run(["losetup", "-d", device], check=False)


@contextmanager
def tree_on_ext4(files: int, mean_size: int, tmp: Path | None) -> Iterator[tuple[Path, Path, list[str]]]:
    """`files` files of random sizes (1 byte .. 2x mean) in folders of 1000 on a fresh loop-mounted ext4."""
    base = Path(tempfile.mkdtemp(prefix="bench_bmap-", dir=tmp))
    try:
        size_mb = 64 + files * (mean_size + 4096 + 512) * 3 // 2 // (1 << 20)
        with loop_ext4(base, size_mb, files + 1024) as (image, mnt):
            rng, payload, keys = random.Random(0), os.urandom(2 * mean_size), []
            for i in range(files):
                if i % 1000 == 0:
                    (mnt / f"c{i // 1000:04d}").mkdir()
                keys.append(f"c{i // 1000:04d}/f{i:07d}.bin")
                (mnt / keys[-1]).write_bytes(payload[: rng.randint(1, 2 * mean_size)])
            os.sync()
            yield image, mnt, keys
    finally:
        shutil.rmtree(base, ignore_errors=True)


def filefrag_seconds(mnt: Path, keys: Sequence[str], procs: int) -> float:
    """Seconds for `filefrag -s -e` over every file, FILEFRAG_BATCH paths per call, `procs` calls at a time."""
    batches = [[str(mnt / k) for k in keys[i : i + FILEFRAG_BATCH]] for i in range(0, len(keys), FILEFRAG_BATCH)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(procs) as pool:
        list(pool.map(lambda b: subprocess.run(["filefrag", "-s", "-e", *b], check=True, stdout=subprocess.DEVNULL),
                      batches))  # fmt: skip
    return time.perf_counter() - t0


def best(fn: Callable[[], float], repeat: int) -> float:
    """The fastest of `repeat` runs (load from elsewhere only ever slows a run down)."""
    return min(fn() for _ in range(repeat))


def mapping_rows(rows: Rows, mnt: Path, keys: Sequence[str], workers: int, out: Path, repeat: int) -> None:
    """build_bmap (1 and W workers, writing the map included) vs filefrag (1 and W processes), metadata warm."""
    from prep.mapping import build_bmap

    def bmap_seconds(w: int) -> float:
        s = build_bmap(mnt, out, workers=w)
        if s.files != len(keys):
            raise Unavailable(f"build_bmap mapped {s.files} of {len(keys)} files")
        return s.seconds

    filefrag_seconds(mnt, keys, workers)  # warm the inode and extent caches for everyone
    n = len(keys)
    for name, kind, fn in (
        (FILEFRAG_1, "peer", lambda: filefrag_seconds(mnt, keys, 1)),
        (f"filefrag -s -e, {workers} processes", "peer", lambda: filefrag_seconds(mnt, keys, workers)),
        ("build_bmap, 1 worker", "ours", lambda: bmap_seconds(1)),
        (f"build_bmap, {workers} workers", "ours", lambda: bmap_seconds(workers)),
    ):
        rows.add(name, lambda: Result(name, "mapping", n, best(fn, repeat), 0, kind, "metadata warm"))  # noqa: B023
    rows.peers["mapping"] = FILEFRAG_1


def read_rows(rows: Rows, image: Path, bmap_path: Path, threads: int, batch: int, repeat: int) -> None:
    """Cold raw reads of every mapped file through BlockdevBackend vs O_DIRECT over the same bytes."""
    from loaders.backends import ReadRequest
    from loaders.backends.blockdev import BlockdevBackend
    from loaders.blockmap.bmap import BlockMap
    from loaders.cache.spec import ALIGN, align_up

    bm = BlockMap.load(bmap_path)
    reqs = [ReadRequest(k, 0, bm.files[k]["size"]) for k in bm.files if bm.files[k]["size"]]
    sizes, n = [r.nbytes for r in reqs], len(reqs)
    total = sum(sizes)

    def epochs(check: bool) -> list[float]:
        """A first epoch (fresh backend: the freshness checks run) and a later one (verdicts cached), cold."""
        out = []
        with warnings.catch_warnings():  # the unchecked mode is measured knowingly: its warning is said above
            warnings.simplefilter("ignore", RuntimeWarning)
            backend = BlockdevBackend(bm, device_path=image, threads=threads, check_stale=check)
        with backend as b:
            for _ in range(2):
                evict([image])
                t0 = time.perf_counter()
                for i in range(0, n, batch):
                    b.read(reqs[i : i + batch])
                out.append(time.perf_counter() - t0)
        return out

    def direct(offsets: Sequence[int], lengths: Sequence[int]) -> float:
        return ceilings.read_direct([ceilings.Span(str(image), o, s) for o, s in zip(offsets, lengths)], threads)[0]

    # the files' own device offsets (their first extent: these small files have one); and as many bytes as
    # one contiguous region where the files' data lies (not the image's start: inode tables there may be
    # holes of the sparse image, which read as free zeros)
    mapped = [bm.source(image).base + bm.files[r.path]["extents"][0][1] for r in reqs]
    big = 1 << 20
    lo = max(0, min(min(mapped) - min(mapped) % ALIGN, image.stat().st_size - align_up(total, big)))
    big_offsets = list(range(lo, lo + align_up(total, big), big))
    bigs = [big] * len(big_offsets)
    same = [lo + int(o) for o in np.cumsum([0] + [align_up(s) for s in sizes[:-1]])]
    cold = "cold (evicted before each run)"
    for name, kind, fn in (
        (f"O_DIRECT 1 MiB requests, {threads} in flight", "ceiling", lambda: direct(big_offsets, bigs)),
        (f"O_DIRECT file-sized requests, {threads} in flight", "peer", lambda: direct(same, sizes)),
        (f"O_DIRECT at the files' offsets, {threads} in flight", "peer", lambda: direct(mapped, sizes)),
        (f"BlockdevBackend {threads} thr, first epoch (stat check)", "ours", lambda: epochs(True)[0]),
        (f"BlockdevBackend {threads} thr, later epoch (checked once)", "ours", lambda: epochs(True)[1]),
        (f"BlockdevBackend {threads} thr, check_stale=False", "ours", lambda: epochs(False)[0]),
    ):  # fmt: skip
        rows.add(name, lambda: Result(name, "raw reads", n, best(fn, repeat), total, kind, cold))  # noqa: B023
    rows.peers["raw reads"] = f"O_DIRECT at the files' offsets, {threads} in flight"


@scenario("bmap", "prep bmap's mapping against filefrag, and raw range reads against O_DIRECT (root).")
def bmap_scenario(
    opts: Options,
    files: Annotated[int, typer.Option(min=1, help="number of small files")] = 100_000,
    threads: Annotated[int, typer.Option(min=1, help="raw read requests in flight")] = 16,
    mean_size: Annotated[int, typer.Option(min=1, help="mean file size in bytes")] = 16384,
    tmp: Annotated[Path | None, typer.Option(help="where the image goes (default: the system temp)")] = None,
    repeat: Annotated[int, typer.Option(min=1, help="runs of each measurement; the best is kept")] = 3,
    reads: Annotated[bool, typer.Option(help="also time the raw reads")] = True,
) -> Rows:
    workers = opts.workers or os.cpu_count() or 4
    rows = Rows(title=f"{files} files (mean {mean_size} B) on a loop-mounted ext4, best of {repeat}")
    try:
        with tree_on_ext4(files, mean_size, tmp) as (image, mnt, keys):
            mapping_rows(rows, mnt, keys, workers, image.parent / "bmap.json", repeat)
            if reads:
                batch = max(opts.batchsize, 1024)  # files per BlockdevBackend.read call
                read_rows(rows, image, image.parent / "bmap.json", threads, batch, repeat)
    except Unavailable as exc:
        rows.skip("bmap", str(exc))
    return rows


def prep_bmap(mnt: Path, out: Path, workers: int) -> Result:
    """`prep bmap` as a user runs it (a fresh process): wall time, and its peak memory from wait4."""
    cmd = [sys.executable, "-m", "prep", "bmap", "--mountpoint", str(mnt), "--output", str(out),
           "--workers", str(workers)]  # fmt: skip
    t0 = time.perf_counter()
    with subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:
        err = proc.stderr.read().decode() if proc.stderr else ""
        _, status, usage = os.wait4(proc.pid, 0)  # wait4: the child's own peak RSS, not this process's
        proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise Unavailable(f"prep bmap failed: {err.strip().splitlines()[-1:] or proc.returncode}")
    n = len(json.loads(out.read_text())["files"])
    name = f"prep bmap --workers {workers}"
    return Result(name, "mapping", n, seconds, 0, "ours", "process start included",
                  {"peak MB": usage.ru_maxrss / 1024, "CPU s": usage.ru_utime + usage.ru_stime})  # fmt: skip


def filefrag_row(mnt: Path, keys: Sequence[str]) -> Result:
    """One filefrag process at a time over every file, with the CPU time its processes used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = filefrag_seconds(mnt, keys, 1)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return Result(FILEFRAG_1, "mapping", len(keys), seconds, 0, "peer", "metadata warm", {"CPU s": cpu})


@scenario("bmap-scale", "prep bmap over a big tree (default 1,000,000 files): time, files/s, peak memory (root).")
def bmap_scale(
    opts: Options,
    files: Annotated[int, typer.Option(min=1, help="number of files")] = 1_000_000,
    mean_size: Annotated[int, typer.Option(min=1, help="mean file size in bytes")] = 4096,
    tmp: Annotated[Path | None, typer.Option(help="where the image goes (default: the system temp)")] = None,
) -> Rows:
    workers = opts.workers or os.cpu_count() or 4
    rows = Rows(peers={"mapping": FILEFRAG_1}, title=f"prep bmap over {files} files (mean {mean_size} B), ext4")
    try:
        with tree_on_ext4(files, mean_size, tmp) as (image, mnt, keys):
            filefrag_seconds(mnt, keys, workers)  # metadata warm for everyone
            rows.add(FILEFRAG_1, lambda: filefrag_row(mnt, keys))
            for w in sorted({1, workers}):
                rows.add(f"prep bmap --workers {w}", lambda: prep_bmap(mnt, image.parent / "bmap.json", w))  # noqa: B023
    except Unavailable as exc:
        rows.skip("bmap-scale", str(exc))
    return rows
