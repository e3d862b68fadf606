"""The benchmark harness: options, result rows, timing, page-cache eviction, optional packages.

Every way of loading is a function that returns a `Result` or raises `Unavailable` with a one-line
reason when it cannot run on this machine (no GPU, no libxnvme, missing package); `Rows.add` runs it and
keeps either. Bytes are the tensor (or file) bytes each way delivers, so GB/s compare like with like.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from loaders.deps import cuda_available, require
from loaders.errors import MissingDependencyError, PrepError

# The peer's median round under this many seconds earns a footer: such rounds do not hold their ratios from run
# to run (docs/benchmarks.md, DALI sources: short rounds)
SHORT_ROUND_S = 0.5


class Unavailable(Exception):  # noqa: N818  (a state, not an error: the run goes on)
    """This way of loading cannot run here; the message says why in one line."""


@dataclass(frozen=True)
class Options:
    """What every subcommand shares."""

    batchsize: int = 4
    batches: int = 4
    cold: bool = True
    device: str = "cpu"
    workers: int = 0  # parallel workers of the scenario (0: its default; MONAI peers: DataLoader in-process)
    out: Path | None = None
    work: Path = Path("bench_out/work")  # scratch for exports and peer caches

    @property
    def items(self) -> int:
        """Items each way delivers in its timed pass."""
        return self.batchsize * self.batches

    @property
    def gpu(self) -> bool:
        """True when the destination is a CUDA device."""
        return self.device.startswith("cuda")


@dataclass
class Result:
    """One row of the table."""

    name: str
    data: str  # which data set the way read ("volumes", "images"): ratios compare within a data set
    items: int
    seconds: float
    nbytes: int
    kind: str = "peer"  # "ours", "peer", "research", "ceiling"
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def items_per_s(self) -> float:
        """Items delivered per second."""
        return self.items / self.seconds if self.seconds > 0 else float("inf")

    @property
    def gb_per_s(self) -> float:
        """Delivered gigabytes (1e9 bytes) per second."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")

    def as_dict(self) -> dict[str, Any]:
        """Plain dict with the derived rates, for CSV/JSON."""
        d = asdict(self)
        d["items_per_s"] = self.items_per_s
        d["gb_per_s"] = self.gb_per_s
        return d


@dataclass
class Rows:
    """What a scenario measured: results, the ways that could not run here (with why), and the reference
    peer per data set that the `x peer` column compares against."""

    results: list[Result] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    peers: dict[str, str] = field(default_factory=dict)  # data set -> name of its reference row
    title: str = ""  # what the data was, for the table heading and the plot title
    footer: list[str] = field(default_factory=list)  # lines printed after the table and kept in bench.json

    def add(self, label: str, job: Callable[[], Result | list[Result]]) -> list[Result]:
        """Run one way; keep its row(s), or print and keep the one-line reason it cannot run here."""
        made = self._run(label, job)
        self.results += made
        return made

    def _run(self, label: str, job: Callable[[], Result | list[Result]]) -> list[Result]:
        try:
            got = job()
        except (Unavailable, PrepError) as exc:  # PrepError: this data lacks what the way needs (one line)
            self.skip(label, (str(exc).splitlines() or [type(exc).__name__])[0].removeprefix(f"{label}: "))
            return []
        made = got if isinstance(got, list) else [got]
        for result in made:
            print(f"  {result.name}: {result.items_per_s:.1f} items/s, {result.gb_per_s:.3f} GB/s", flush=True)
        return made

    def add_rounds(
        self, jobs: Sequence[tuple[str, Callable[[], Result]]], rounds: int, peer: str = "", ceiling: str = "",
        best_of: Mapping[str, str] | None = None,
    ) -> None:  # fmt: skip
        """Run every way once per round, the ways interleaved (a load that comes and goes on a shared box
        hits them alike); keep one row per way: the round of median rate (items/s; not of median time: a round
        times as many epochs as its minimum time needs, so a faster round may take longer). With more than one
        round, its `extra` holds the rounds, their items/s range and, against the rows named `peer` and `ceiling`, the
        median of the per-round ratios (each against that row's run of the same round). `best_of` maps a
        job's label to another's: in each round the faster of the two runs is kept, under the other label
        (a ceiling measured first and again last in every round)."""
        runs: dict[str, list[Result]] = {}
        for r in range(rounds):
            if rounds > 1:
                print(f"  round {r + 1}/{rounds}", flush=True)
            for label, job in jobs:
                if r and label not in runs:
                    continue  # could not run here: said once
                for result in self._run(label, job)[:1]:
                    runs.setdefault(label, []).append(result)
        for again, first in (best_of or {}).items():
            if again in runs and first in runs and len(runs[again]) == len(runs[first]):
                pairs = zip(runs[first], runs.pop(again))
                runs[first] = [max(a, b, key=lambda x: x.items_per_s) for a, b in pairs]
        against = {key: next((v for v in runs.values() if v[0].name == name), None)
                   for key, name in (("x peer per round", peer), ("x ceiling per round", ceiling)) if name}  # fmt: skip
        self._short_rounds(against.get("x peer per round"), peer)
        for made in runs.values():
            row = sorted(made, key=lambda x: x.items_per_s)[(len(made) - 1) // 2]
            if len(made) > 1:
                rates = [x.items_per_s for x in made]
                row.extra.update(rounds=len(made), min=min(rates), max=max(rates))
                row.extra["per round"] = [round(x, 3) for x in rates]
                for key, base in against.items():
                    if base is not None and row.name != base[0].name and len(base) == len(made):
                        per_round = [x.items_per_s / b.items_per_s for x, b in zip(made, base)]
                        row.extra[key] = f"{float(np.median(per_round)):.2f}"
            self.results.append(row)

    def _short_rounds(self, peer_runs: list[Result] | None, peer: str) -> None:
        """A footer where the peer's median round was shorter than SHORT_ROUND_S (ratios of such rounds do
        not hold from run to run)."""
        if not peer_runs or len(peer_runs) < 2:
            return
        seconds = float(np.median([x.seconds for x in peer_runs]))
        if seconds < SHORT_ROUND_S:
            self.footer.append(
                f"rounds: {peer}'s took {seconds:.2f} s (median); ratios of rounds under {SHORT_ROUND_S} s move by "
                "tens of percent between runs: time longer rounds (more --batches, over more items) for ones that hold"
            )

    def skip(self, label: str, why: str) -> None:
        """Keep (and print) that `label` cannot run here, and why."""
        self.skipped.append((label, why))
        print(f"  unavailable: {label}: {why}", flush=True)

    def extend(self, other: Rows) -> None:
        """Append another scenario's rows (for `all`)."""
        self.results += other.results
        self.skipped += other.skipped
        self.peers = {**other.peers, **self.peers}
        self.footer += other.footer


def nbytes_of(obj: Any) -> int:
    """Bytes of every array-like leaf of a (nested) batch: numpy, torch (CPU or GPU), DALI TensorList."""
    if isinstance(obj, dict):  # "_items", "_meta": bookkeeping, not data
        return sum(nbytes_of(v) for k, v in obj.items() if not str(k).startswith("_"))
    if isinstance(obj, (list, tuple)):
        return sum(nbytes_of(v) for v in obj)
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):  # torch.Tensor without importing torch
        return int(obj.element_size() * obj.numel())
    if hasattr(obj, "as_array") or hasattr(obj, "as_cpu"):  # DALI TensorList(CPU|GPU): from its shapes
        # no copy: a GPU batch copied to the host here would sit on the thread that also runs an external
        # source's reads, and a training loop hands GPU batches on as they are
        from nvidia.dali.types import to_numpy_type

        itemsize = np.dtype(to_numpy_type(obj.dtype)).itemsize
        return itemsize * sum(int(np.prod(shape, dtype=np.int64)) for shape in obj.shape())
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return len(obj)
    return 0


def time_batches(batches: Iterator[Any], count: int, sync: Callable[[], None] | None = None) -> tuple[float, int]:
    """Pull `count` batches; return (seconds, delivered bytes). `sync` waits for a GPU before the clock stops."""
    total = 0
    start = time.perf_counter()
    for _ in range(count):
        total += nbytes_of(next(batches))
    if sync is not None:
        sync()
    return time.perf_counter() - start, total


def cycle(n: int, count: int) -> list[int]:
    """`count` item indices 0..n-1 in order, wrapping around when the data set is smaller."""
    if n < 1:
        raise Unavailable("the data set is empty")
    return [i % n for i in range(count)]


def chunks(seq: Sequence[Any], size: int) -> Iterator[Sequence[Any]]:
    """Consecutive slices of `size` (the last may be shorter)."""
    for i in range(0, len(seq), size):
        yield seq[i : i + size]


def settle() -> None:
    """Write out what is dirty in every filesystem (sync(2), which waits for it) before a pass is timed. Reads
    leave writes pending on a writable mount: a file's first read after it was written updates its atime
    under `relatime`, and the journal commits that seconds later, while the next way is timed. Such a write
    costs the pass it lands in, and `BmapSource` checks each file's extents again after any write to its
    device: a pass with writes ran slower than the same pass on a quiet device (docs/benchmarks.md, DALI sources)."""
    os.sync()


def start_pass(paths: Iterable[str | os.PathLike[str]], cold: bool) -> str:
    """Before a timed pass: `settle`, and for a cold pass `evict` the files. Returns how ("warm" or evict's)."""
    if cold:
        return evict(paths)
    settle()
    return "warm"


def evict(paths: Iterable[str | os.PathLike[str]], drop_caches: bool = True) -> str:
    """Push files out of the page cache so the next read comes from the device; returns how it was done.

    posix_fadvise(DONTNEED) per file works unprivileged but only drops clean pages, hence `settle` first
    (one sync, not a flush of the device per file); as root, /proc/sys/vm/drop_caches also drops the rest of
    the page cache (a loop image's pages among them). Then `touch_memory` of twice the bytes evicted: the
    pass's reads allocate page cache (a loop-mounted file's pages and its image's) from memory just freed.
    """
    settle()
    count = nbytes = 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            nbytes += min(st.st_size, st.st_blocks * 512)  # a sparse image holds only its written blocks
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            count += 1
        finally:
            os.close(fd)
    how = f"fadvise({count} files)"
    if drop_caches and os.geteuid() == 0:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
            how += "+drop_caches"
        except OSError:
            pass  # read-only /proc/sys in many containers: fadvise alone still evicts the data pages
    touched = touch_memory(2 * nbytes)
    return how + (f"+{touched >> 20} MiB touched" if touched >> 20 else "")


def touch_memory(nbytes: int) -> int:
    """Fault in up to `nbytes` of fresh memory (at most half of the available memory) and free it again; returns the
    bytes touched. A virtual machine whose balloon driver reports free pages to the host (virtio-balloon free
    page reporting, 2 s after they are freed) gets such a page back from the host on its first touch, at a
    fraction of memory speed (docs/benchmarks.md, DALI sources). An eviction frees hundreds of MiB; a cold pass timed
    seconds later then paid that in whichever thread first touched the pages its reads allocated (the loop
    driver's thread copies for the readers through the filesystem; `BmapSource`'s own thread copies from its
    image). Pages touched and
    freed here go back to the free lists, backed, and the pass's allocations take them."""
    import mmap

    from loaders.machine import available_memory

    nbytes = min(nbytes, available_memory() // 2)
    page = mmap.PAGESIZE
    nbytes -= nbytes % page
    if nbytes <= 0:
        return 0
    with mmap.mmap(-1, nbytes) as m:
        view = np.frombuffer(m, np.uint8)
        view[::page] = 1  # one write a page: the kernel zeroes (touches) each whole page on its fault
        del view
    return nbytes


def files_under(root: str | os.PathLike[str], suffixes: tuple[str, ...] = ()) -> list[str]:
    """Regular files under `root`, sorted, optionally only those ending in one of `suffixes` (case-insensitive)."""
    out = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            if not suffixes or name.lower().endswith(suffixes):
                out.append(os.path.join(dirpath, name))
    return sorted(out)


def cuda_sync(device: str) -> Callable[[], None] | None:
    """A function that waits for `device` (None on CPU)."""
    if not device.startswith("cuda"):
        return None
    import torch

    return lambda: torch.cuda.synchronize(torch.device(device))


def optional(name: str, purpose: str = "") -> ModuleType:
    """Import an optional package or raise Unavailable with the install command in one line."""
    try:
        return require(name, purpose)
    except MissingDependencyError as exc:
        raise Unavailable(str(exc).splitlines()[0]) from exc


def require_gpu(opts: Options, what: str) -> None:
    """Raise Unavailable unless the run targets a CUDA device that torch can see."""
    if not opts.gpu:
        raise Unavailable(f"{what} needs --device cuda:N (this run is on {opts.device})")
    if not cuda_available():
        raise Unavailable(f"{what} needs a CUDA GPU; torch sees none here")
