"""Cold epochs of the training benchmark (`train --cold-epochs`): every epoch of a row starts with the
workload's files out of the page cache, and the row reports the bytes it read from disk per timed epoch
against the bytes its crops need; the disk's own read rate (O_DIRECT over the prepared cache's shards,
sequential and 4 KiB random) is measured in the same run as the ceiling of reading.

Bytes read come from the block device holding the data (`/sys/dev/block/MAJ:MIN/stat`, sectors read: the
whole device, so another job reading it at the same time is counted too) or, where the data lies on no block
device this kernel names (overlayfs, btrfs subvolumes, NFS, tmpfs), from `/proc/<pid>/io` `read_bytes` summed
over this process and its descendants (DataLoader workers, a feeder's child; a child reaped in between is
folded into its parent's count by the kernel).
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workflows.bench.ceilings import ALIGN, Span, read_direct
from workflows.bench.core import Unavailable, evict, files_under

SECTOR = 512  # /sys/block/*/stat counts 512-byte sectors whatever the device's own block size
SEQUENTIAL_REQUEST = 1 << 20  # the sequential rate's request size
SEQUENTIAL_BYTES = 1 << 30  # ... over at most this many bytes of the shards (the first ones)
RUN_BYTES = 64 << 10  # the second random pass's request: about one x-plane's run of a crop's rows
RANDOM_READS = 4096  # the random rate: this many 4 KiB reads at aligned offsets drawn over every shard

__all__ = [
    "ColdEpochs",
    "EpochReads",
    "ReadCounter",
    "crop_bytes_per_step",
    "disk_rate_line",
    "disk_rates",
    "read_counters",
    "sequential_spans",
]


@dataclass(frozen=True)
class ReadCounter:
    """Bytes read from disk so far (`read()`), and what counts them (`how`, for the row)."""

    how: str
    read: Callable[[], int]


def block_stat(path: str | os.PathLike[str]) -> Path | None:
    """The `stat` file of the block device (a partition, a loop or device-mapper device included) holding
    `path`, or None where st_dev names no block device in /sys (overlayfs, btrfs, NFS, tmpfs)."""
    st = os.stat(path)
    stat = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
    return stat if stat.is_file() else None


def _device_name(stat: Path) -> str:
    """'vda', 'vda1 (a partition)', 'loop3 (backing /img)': the device `stat` belongs to."""
    folder = stat.parent.resolve()
    name = folder.name
    if (folder / "partition").is_file():
        return f"{name} (a partition)"
    backing = folder / "loop" / "backing_file"
    if backing.is_file():
        return f"{name} (loop device over {backing.read_text().strip()})"
    return name


def _sectors_read(stat: Path) -> int:
    return int(stat.read_text().split()[2]) * SECTOR


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (/proc/<pid>/task/<tid>/children, recursively)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            continue  # gone since: its bytes went to its parent when it was reaped
    return out


def proc_read_bytes(pid: int) -> int:
    """`read_bytes` of /proc/<pid>/io summed over `pid` and its descendants (0 for one that cannot be read)."""
    total = 0
    for p in _descendants(pid):
        try:
            for line in Path(f"/proc/{p}/io").read_text().splitlines():
                if line.startswith("read_bytes:"):
                    total += int(line.split()[1])
        except (OSError, ValueError):
            continue
    return total


def read_counters(path: str | os.PathLike[str], pid: int) -> tuple[ReadCounter, ...]:
    """The block device's counter for `path` where /sys names it, then /proc io of `pid`'s process tree (on a
    shared machine the device counts other jobs' reads too; the process tree counts only the row's);
    Unavailable where neither can be read."""
    stat = block_stat(path)
    device = (ReadCounter(f"block device {_device_name(stat)}", lambda: _sectors_read(stat)),) if stat else ()
    if not Path(f"/proc/{pid}/io").is_file():
        if device:
            return device
        raise Unavailable(f"{path}: no block device in /sys and no /proc/{pid}/io: no bytes-read counter here")
    return (*device, ReadCounter("/proc io of the benchmark and its children", lambda: proc_read_bytes(pid)))


def crop_bytes_per_step(batch: dict[str, tuple[tuple[int, ...], str]], dtypes: dict[str, Any]) -> int:
    """Bytes one step's crops need: per key of the batch (shape: rows x channels x crop), its voxels times the
    cache's dtype size for that key; keys the cache lacks count nothing."""
    import numpy as np

    total = 0
    for key, (shape, _kind) in batch.items():
        if key in dtypes:
            total += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtypes[key]).itemsize
    return total


@dataclass
class ColdEpochs:
    """What a cold epoch evicts first (every file of the workload) and how its bytes read are counted."""

    folders: tuple[Path, ...]  # listed again at every eviction: a row's own cache is written by its first epoch
    counters: tuple[ReadCounter, ...]  # the first gives the row's bytes read; a second, the process tree's
    crop_bytes: int  # one step's crops, 0 where unknown (a workload with no crop batch)
    evicted: str = ""  # how the last eviction was done

    @classmethod
    def of(cls, folders: Iterable[Path], counters: tuple[ReadCounter, ...], crop_bytes: int) -> ColdEpochs:
        """Every regular file under `folders` (those that exist when an epoch starts)."""
        return cls(tuple(folders), counters, crop_bytes)

    @property
    def files(self) -> list[str]:
        """The regular files under the folders now."""
        return [f for d in self.folders if d.is_dir() for f in files_under(d)]

    def row(self) -> EpochReads:
        """A fresh tally for one row."""
        return EpochReads(self)


@dataclass
class EpochReads:
    """One row's cold epochs: `begin` before an epoch is requested (evict, read the counter), `end` after its
    last batch; the timed epochs' bytes add up."""

    cold: ColdEpochs
    nbytes: list[int] = field(default_factory=list)  # per counter, over the timed epochs
    epochs: int = 0
    _at: list[int] = field(default_factory=list, repr=False)

    def begin(self) -> None:
        """Evict every file of the workload, then start counting. Its files only (a sync, then fadvise drops
        every page of them, all clean): `drop_caches` would also drop the code pages of every running process
        (torch's and CUDA's libraries), which a dataset streaming through the page cache does not push out (the
        kernel keeps mapped, active pages); it made a row that starts a process within its timed epochs (a
        feeder's child importing torch and MONAI) re-read its libraries from disk at every epoch."""
        self.cold.evicted = evict(self.cold.files, drop_caches=False)
        self._at = [c.read() for c in self.cold.counters]

    def end(self, timed: bool) -> None:
        """The epoch's bytes read, kept when it was timed."""
        if timed:
            now = [c.read() - at for c, at in zip(self.cold.counters, self._at)]
            self.nbytes = [a + b for a, b in zip(self.nbytes, now)] if self.nbytes else now
            self.epochs += 1

    def fields(self, steps: int) -> dict[str, Any]:
        """The row's columns: MB read and the crops' MB per timed epoch, their ratio, what counted them."""
        if not self.epochs:
            return {}
        read = self.nbytes[0] / self.epochs
        out: dict[str, Any] = {"read MB/epoch": round(read / 1e6, 3)}
        if self.cold.crop_bytes:
            crops = self.cold.crop_bytes * steps / self.epochs
            out.update({"crops MB/epoch": round(crops / 1e6, 3), "read/crops": round(read / crops, 2)})
        out["read counted by"] = self.cold.counters[0].how
        if len(self.nbytes) > 1:  # the device's count holds other jobs' reads too: the row's own beside it
            out["process tree read MB/epoch"] = round(self.nbytes[1] / self.epochs / 1e6, 3)
        return out


def sequential_spans(shards: list[Path]) -> list[Span]:
    """The sequential rate's requests: 1 MiB in file order over up to the first GiB of `shards`."""
    seq, left = [], SEQUENTIAL_BYTES
    for p in shards:
        size = os.path.getsize(p) // ALIGN * ALIGN
        for off in range(0, min(size, left), SEQUENTIAL_REQUEST):
            seq.append(Span(str(p), off, min(SEQUENTIAL_REQUEST, size - off)))
        left -= min(size, left)
    return seq


def disk_rates(shards: list[Path], depth: int, seed: int = 0) -> str:
    """One line: the disk's O_DIRECT read rate over `shards`, sequential (1 MiB requests over up to 1 GiB) and
    random (4 KiB, then 64 KiB: a crop's run of x-plane rows, at aligned offsets), `depth` in flight, each pass
    after evicting the shards."""
    seq = sequential_spans(shards)
    rng = random.Random(seed)
    small = _random_spans(shards, ALIGN, RANDOM_READS, rng)
    if not seq or not small:
        raise Unavailable("the prepared cache's shards are empty: no disk rate")
    runs = _random_spans(shards, RUN_BYTES, RANDOM_READS // 4, rng)
    s_sec, s_bytes, _ = read_direct(seq, depth)
    parts = [f"sequential 1 MiB requests {s_bytes / s_sec / 1e9:.3f} GB/s over {s_bytes / 1e6:.1f} MB"]
    for spans in (small, runs):
        if spans:
            sec, nbytes, _ = read_direct(spans, depth)
            parts.append(
                f"random {spans[0].nbytes >> 10} KiB {nbytes / sec / 1e6:.1f} MB/s ({len(spans) / sec:.0f} IOPS)"
            )
    return (
        f"disk read rate (O_DIRECT over the prepared cache's shards, {depth} in flight, evicted first): "
        + "; ".join(parts)
    )


def _random_spans(shards: list[Path], nbytes: int, count: int, rng: random.Random) -> list[Span]:
    """`count` reads of `nbytes` at random `nbytes`-aligned offsets of `shards` (weighted by size; none where every
    shard is shorter)."""
    blocks = [(str(p), os.path.getsize(p) // nbytes) for p in shards]
    blocks = [(path, n) for path, n in blocks if n]
    if not blocks:
        return []
    picks = rng.choices(blocks, weights=[n for _, n in blocks], k=count)
    return [Span(path, rng.randrange(n) * nbytes, nbytes) for path, n in picks]


def disk_rate_line(shards: list[Path], seed: int = 0) -> str:
    """`disk_rates` at the cold reads' own depth (`loaders.tunables.COLD_INFLIGHT`, at most 8 a core), or the
    line saying why not; printed as it is measured."""
    from loaders.tunables import COLD_INFLIGHT

    depth = min(COLD_INFLIGHT, 8 * len(os.sched_getaffinity(0)))
    try:
        rate = disk_rates(shards, depth, seed)
    except Unavailable as exc:
        rate = f"disk read rate: not measured ({exc})"
    print(f"  {rate}", flush=True)
    return rate
