"""What blockprep's DALI sources share: the class-folder listing `fn.readers.file` makes, and `_EpochSource`,
the epochs, batches and reads ahead of `FileSource` (`loaders.faces.dali`) and `BmapSource`
(`loaders.faces.dali_bmap`)."""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from loaders import args
from loaders.backends import Backend, ReadRequest
from loaders.cache.order import dali_shard, epoch_batches, epoch_order
from loaders.errors import ArgumentValueError
from loaders.tunables import HINT_BATCHES, IDLE_READS

# fn.readers.file's default `file_filters` (DALI 1.3x-2.x)
DEFAULT_FILE_FILTERS: tuple[str, ...] = (
    "*.jpg", "*.jpeg", "*.png", "*.bmp", "*.tif", "*.tiff", "*.pnm", "*.ppm", "*.pgm", "*.pbm", "*.jp2",
    "*.webp", "*.flac", "*.ogg", "*.wav",
)  # fmt: skip


def _matches(name: str, filters: Sequence[str], case_sensitive: bool) -> bool:
    if not case_sensitive:
        name, filters = name.lower(), [f.lower() for f in filters]
    return any(fnmatch.fnmatchcase(name, f) for f in filters)


def list_labeled_files(
    root: str | os.PathLike[str],
    file_filters: Sequence[str] = DEFAULT_FILE_FILTERS,
    case_sensitive_filter: bool = False,
    follow_links: bool = True,
) -> list[tuple[str, int]]:
    """(path relative to root, label) as `fn.readers.file(file_root=root)` lists them: every subfolder of
    root in byte order is a label (empty ones too), its matching files in byte order; nothing deeper.
    follow_links=False leaves out symlinked folders and files (a block map's tree: nothing outside its root)."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder of class subfolders")
    with os.scandir(root) as entries:
        classes = sorted((d.name for d in entries if d.is_dir(follow_symlinks=follow_links)), key=os.fsencode)
    out = []
    for label, name in enumerate(classes):
        files = [
            f.name
            for f in os.scandir(root / name)
            if f.is_file(follow_symlinks=follow_links) and _matches(f.name, file_filters, case_sensitive_filter)
        ]
        out += [(f"{name}/{f}", label) for f in sorted(files, key=os.fsencode)]
    return out


def _average(mean: float, value: float) -> float:
    """A moving average that follows the last few values (the first one as it is)."""
    return value if mean == 0 else mean + 0.25 * (value - mean)


class _EpochSource:
    """Batches of positions over `n` samples: shard, per-epoch shuffle, short last batch. With `readahead`
    on, the next batch of the epoch is read ahead (`_start`) while the pipeline uses this one, when its reads
    would wait on the disk (`_waits`); a batch already in memory is read when it is asked for, on the
    pipeline's thread. Read ahead on a thread, its Python contends with the pipeline's for the interpreter
    lock: reading every batch ahead was slower than reading it when asked (docs/benchmarks.md, DALI
    sources). Where the consumer spends
    longer between batches than IDLE_READS reads (a pipeline that decodes), warm batches are read ahead on the
    thread: its reads then overlap the time the pipeline's thread waits.

    With `cold_epochs` (FileSource, BmapSource), an epoch whose first batch is cold is cold throughout: its
    first `_depth()` batches are started at once and kept that many ahead, with no probe of each next batch
    (FileSource's io_uring reads: 4 batches in flight; BmapSource: 3, read one after another). A source
    whose reads are plain and whose `_hint` acts hints a cold epoch's first HINT_BATCHES batches as it starts
    and keeps hinting HINT_BATCHES past the batches read ahead, on a thread of its own so that the hints
    reach the disk in the epoch's order; outside a cold epoch, it goes on hinting while the first batch not
    yet hinted is cold."""

    readahead = False
    cold_epochs = False  # a cold first batch makes the epoch cold: batches are read ahead without probes

    def __init__(self, n: int, batch_size: int, shuffle: bool, seed: int, shard_id: int, num_shards: int) -> None:
        args.check_epoch_source(batch_size, shuffle, seed, shard_id, num_shards)  # subclasses call it first too
        self.positions = dali_shard(n, shard_id, num_shards)
        if not len(self.positions):  # DALI would stop on a bare StopIteration at its first batch
            raise ArgumentValueError(
                f"{type(self).__name__}: shard_id {shard_id} of num_shards {num_shards} holds none of the {n} "
                "samples; use fewer shards than samples"
            )
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = -1
        self._order: np.ndarray = self.positions
        self._chunks: list[np.ndarray] = []
        self._next = 0  # the epoch's next batch
        self._ahead: dict[tuple[int, int], Future[Any]] = {}  # (epoch, batch): its read, running or done
        self._ahead_pool: ThreadPoolExecutor | None = None
        self._hint_pool: ThreadPoolExecutor | None = None
        self._hinted = 0
        self._cold_epoch = False
        self._read_s = 0.0  # seconds a batch read when asked took (moving average)
        self._idle_s = 0.0  # seconds the consumer spent between two batches (moving average)
        self._left = 0.0  # when the last batch was handed over (0: none yet this epoch)

    def __len__(self) -> int:
        """Batches per epoch."""
        return -(-len(self.positions) // self.batch_size)

    def __iter__(self) -> Any:
        self._settle()
        self.epoch += 1
        self._order = self.positions[epoch_order(len(self.positions), self.seed, self.epoch, shuffle=self.shuffle)]
        self._chunks = epoch_batches(self._order, self.batch_size, drop_last=False)
        self._next = 0
        self._hinted = 0  # the last batch of this epoch hinted to the kernel (batch 0 is read at once)
        self._cold_epoch = False  # it started cold: hints go on without a probe on this thread (`_hint` probes)
        self._left = 0.0
        return self

    def __next__(self) -> Any:
        k = self._next
        if k >= len(self._chunks):
            raise StopIteration
        chunk = [int(i) for i in self._chunks[k]]
        self._next += 1
        if not self.readahead:
            return self._batch(chunk)
        if k == 0 and self.cold_epochs and self._waits(chunk):  # a cold epoch: its first batches go at once
            self._cold_epoch = True
            if self._hints:
                first = self._chunks[: min(HINT_BATCHES, len(self._chunks))]
                self._hinted = len(first) - 1
                self._pool_hints().submit(self._hint, [int(i) for c in first for i in c])
            self._plan_ahead(0)
        start = time.perf_counter()
        if self._left:
            self._idle_s = _average(self._idle_s, start - self._left)
        ahead = self._ahead.pop((self.epoch, k), None)
        if ahead is not None:
            batch = ahead.result()
        else:
            batch = self._batch(chunk)
            self._read_s = _average(self._read_s, time.perf_counter() - start)
        self._plan_ahead(self._next)
        self._left = time.perf_counter()
        return batch

    def _consumer_idle(self) -> bool:
        """Whether the consumer spends more than IDLE_READS times a batch's read away between two batches (a
        pipeline that decodes): a batch read ahead on a thread then overlaps that time. Where it comes back at
        once (no decode), the thread's Python would only contend with the pipeline's for the interpreter lock."""
        return 0 < self._read_s * IDLE_READS < self._idle_s

    def _plan_ahead(self, first: int) -> None:
        """Batch `first` on: in a cold epoch keep the next `_depth()` batches being read (no probe: it
        started cold); otherwise read the next batch ahead only if it would wait on the disk, or, on the
        read-ahead thread, if the consumer leaves time for it (`_consumer_idle`). Hint the batches after those
        read ahead."""
        if first >= len(self._chunks):
            return
        if self._cold_epoch:
            last = min(first + self._depth(), len(self._chunks))
            for j in range(first, last):
                if (self.epoch, j) not in self._ahead:
                    self._ahead[(self.epoch, j)] = self._start([int(i) for i in self._chunks[j]])
            if self._hints:
                self._hint_to(last - 1 + HINT_BATCHES)
            return
        nxt = [int(i) for i in self._chunks[first]]
        if self._waits(nxt):  # cold: read it ahead, hint the batches after it
            self._ahead[(self.epoch, first)] = self._start(nxt)
            self._hint_to(first + HINT_BATCHES)
        elif self._consumer_idle():  # warm, and the consumer leaves time: read it on the read-ahead thread
            self._ahead[(self.epoch, first)] = _EpochSource._start(self, nxt)
        elif self._hints and self._cold_beyond_hints():  # keep the disk busy
            self._hint_to(first + HINT_BATCHES)

    def _start(self, positions: list[int]) -> Any:
        """Begin reading a batch ahead; the result has `result()` (the batch) and `exception()`."""
        return self._pool_ahead().submit(self._batch, positions)

    def _depth(self) -> int:
        """Batches a cold epoch keeps being read ahead."""
        return 1

    @property
    def _hints(self) -> bool:
        """Whether this source's `_hint` does anything (FileSource's WILLNEED)."""
        return type(self)._hint is not _EpochSource._hint

    def _cold_beyond_hints(self) -> bool:
        """Whether the first batch not yet hinted would wait on the disk (none left: False)."""
        first = max(self._hinted, self._next) + 1
        return first < len(self._chunks) and self._waits([int(self._chunks[first][0])])

    def _waits(self, positions: list[int]) -> bool:
        """Whether reading these samples would wait on the disk (the first one tells; True where that cannot
        be told)."""
        return True

    def _hint_to(self, last: int) -> None:
        """Hint the batches not yet hinted up to `last` (on the read-ahead pool: opening cold files waits)."""
        later = range(max(self._hinted, self._next) + 1, min(last + 1, len(self._chunks)))
        if not len(later):
            return
        self._hinted = later[-1]
        self._pool_hints().submit(self._hint, [int(i) for j in later for i in self._chunks[j]])

    def _pool_ahead(self) -> ThreadPoolExecutor:
        """One thread: the batch read ahead."""
        if self._ahead_pool is None:
            self._ahead_pool = ThreadPoolExecutor(1, thread_name_prefix="blockprep-readahead")
        return self._ahead_pool

    def _pool_hints(self) -> ThreadPoolExecutor:
        """One thread: the hints, in the epoch's order."""
        if self._hint_pool is None:
            self._hint_pool = ThreadPoolExecutor(1, thread_name_prefix="blockprep-hints")
        return self._hint_pool

    def _hint(self, positions: list[int]) -> None:
        """Tell the kernel that these samples are read soon (no-op here; FileSource: cold files' WILLNEED)."""

    def _settle(self) -> None:
        """Wait for a read-ahead nobody will take (its errors belong to a batch never asked for)."""
        ahead, self._ahead = self._ahead, {}
        for read in ahead.values():
            read.exception()

    def _batch(self, positions: list[int]) -> Any:
        raise NotImplementedError

    def close(self) -> None:
        """Release the descriptors and threads this source opened (it may be iterated again after)."""
        self._settle()
        for pool in (self._ahead_pool, self._hint_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._ahead_pool = self._hint_pool = None

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _labels(files: Sequence[tuple[str, int]], positions: Sequence[int]) -> np.ndarray:
    """A batch's labels as one (B, 1) int32 array: to DALI, B samples of shape (1,) as `fn.readers.file`
    gives them, ingested in one copy (a list of B one-element arrays cost DALI a third of a batch's time)."""
    return np.array([files[i][1] for i in positions], dtype=np.int32).reshape(-1, 1)


def _read_files(backend: Backend, paths: Sequence[str], sizes: Sequence[int]) -> list[np.ndarray]:
    """All files of a batch in one backend call (many requests in flight)."""
    buffers = backend.read([ReadRequest(p, 0, n) for p, n in zip(paths, sizes)])
    return [np.asarray(b) for b in buffers]
