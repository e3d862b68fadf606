"""DALI face: sources for `fn.external_source(source=..., batch=True)` that read through blockprep backends.

    @pipeline_def(batch_size=32, num_threads=4, device_id=0)
    def pipe():
        src = FileSource("train/", batch_size=32)
        jpegs, labels = fn.external_source(source=src, num_outputs=2, batch=True, cycle="raise")
        return fn.decoders.image(jpegs, device="mixed"), labels

- `FileSource`: files of a class-folder tree through any backend, with labels exactly as
  `fn.readers.file(file_root=...)` derives them (sorted subfolders, one level, DALI's file filters).
- `BmapSource`: files of a block map read as raw device ranges (`blockdev`, or `xnvme`).
- `CacheSource`: prepared-cache tensors as numpy (CPU) or CUDA torch tensors (GPU; use
  `fn.external_source(device="gpu")`), one dense batch per key.

Each source is an iterable: one epoch per `iter()`, StopIteration at its end, a new shuffle each epoch
(seed + epoch). Pass `cycle="raise"` to external_source for epochs (StopIteration, then `pipe.reset()`).
DALI itself is only needed to run the pipeline, not to build a source.
"""

from __future__ import annotations

import fnmatch
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from loaders import args, uring
from loaders.backends import BLOCK_RANGE_BACKENDS, Backend, ReadRequest, get_backend
from loaders.errors import ArgumentTypeError, ArgumentValueError, BackendError
from loaders.files import HINT_BYTES, _resident, hint_files, read_whole_files
from loaders.order import dali_shard, epoch_batches, epoch_order

# fn.readers.file's default `file_filters` (DALI 1.3x-2.x)
DEFAULT_FILE_FILTERS = (
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
) -> list[tuple[str, int]]:
    """(path relative to root, label) as `fn.readers.file(file_root=root)` lists them: every subfolder of
    root in byte order is a label (empty ones too), its matching files in byte order; nothing deeper."""
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: no such folder of class subfolders")
    classes = sorted((d.name for d in os.scandir(root) if d.is_dir()), key=os.fsencode)
    out = []
    for label, name in enumerate(classes):
        files = [
            f.name
            for f in os.scandir(root / name)
            if f.is_file() and _matches(f.name, file_filters, case_sensitive_filter)
        ]
        out += [(f"{name}/{f}", label) for f in sorted(files, key=os.fsencode)]
    return out


# A warm batch is read ahead on a thread where the consumer spends more than this many times a batch's read between
# two batches (H200 box, 2026-11-27, DALI's GPU decoder, 5,000 warm JPEGs, 5 rounds: read ahead on a thread
# FileSource 1.26x fn.readers.file's images/s, read when asked 1.08x); where it comes back at once, reading ahead on a
# thread lost (2-core box, no decode: 0.92 against 1.07-1.11 read when asked)
IDLE_READS = 2.0


def _average(mean: float, value: float) -> float:
    """A moving average that follows the last few values (the first one as it is)."""
    return value if mean == 0 else mean + 0.25 * (value - mean)


class _EpochSource:
    """Batches of positions over `n` samples: shard, per-epoch shuffle, short last batch. With `readahead`
    on, the next batch of the epoch is read ahead (`_start`) while the pipeline uses this one, when its reads
    would wait on the disk (`_waits`); a batch already in memory is read when it is asked for, on the
    pipeline's thread. Read ahead on a thread, its Python contends with the pipeline's for the interpreter
    lock: on the 2-core box (2026-11-26, 5,000 warm JPEGs, 5 rounds) reading every batch ahead gave 0.92-0.93
    of `readers.file`'s files/s for both sources, reading it when asked 1.07-1.11. Where the consumer spends
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


def read_threads(cores: int) -> int:
    """FileSource's read threads for warm batches: one, whatever the cores. Reading holds the GIL for its
    per-file Python, and each thread waits for it again after every syscall. Files/s through a DALI pipeline,
    warm, no decode: 2-core box (2026-11-24) 1 thread 45,300, 2 threads 41,700, 4 threads 29,900 (readers.file
    41,500); 16-core H200 box (2026-11-27, 5 rounds, two passes) 4 threads 0.37-0.39x readers.file, 1 thread
    0.81-0.99x. `cores` is kept for callers that pass it."""
    return 1


# Batches past the one read ahead whose files FileSource hints to the kernel (posix_fadvise WILLNEED) when they are
# cold: the kernel reads them asynchronously, so the disk has more requests in flight than the read threads make
HINT_BATCHES = 6
# FileSource's read threads for a batch whose first file is not in the page cache (cold data): the 2-core CPU box
# read a cold loop-mounted tree at 0.57x fn.readers.file with its one warm-data thread (2026-11-25)
COLD_READ_THREADS = 8
# FileSource's io_uring reads (`loaders.uring`): in a cold epoch up to URING_BATCHES batches are in flight, at most
# URING_FILES files (each holds a descriptor while in flight); a batch of more files is read with plain reads
URING_BATCHES = 4
URING_FILES = 256
# BmapSource's cold epochs: up to this many batches read ahead, one after another on the read-ahead thread (each
# batch's device ranges in parallel), at most about HINT_BYTES. 2-core box, 2026-11-27, 5,000 cold 17 KiB JPEGs
# on a loop-mounted ext4, 5 rounds: one batch ahead 1.09x fn.readers.file's files/s, two 1.42x, three 1.36x
BMAP_COLD_BATCHES = 3


class FileSource(_EpochSource):
    """(encoded bytes, label) batches of a class-folder tree, read through `backend`.

    Yields ([uint8 arrays], a (B, 1) int32 array: B labels of shape (1,)) like `fn.readers.file`'s two
    outputs; use
    `fn.external_source(source=src, num_outputs=2, batch=True)`. `files` holds the (path, label) list.

    backend "auto" (default): whole files through the page cache. Batches read when asked for (warm ones)
    are read on `threads` threads (`threads=None`: `read_threads(os.cpu_count())`, one). In a cold epoch,
    where io_uring can be used (`loaders.uring.available()`), 4 batches are kept in flight, each batch's
    reads submitted together, so the kernel merges the reads of files that lie next to each other on the
    disk (2-core box, 2026-11-27, 5,000 cold 17 KiB JPEGs: 1.06-1.20x `fn.readers.file`); elsewhere a cold
    batch is read on `COLD_READ_THREADS` threads, with WILLNEED hints ahead.
    Any other name or Backend: that backend, sizes from one stat per file."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        backend: str | Backend = "auto",
        batch_size: int = 32,
        shuffle: bool = False,
        seed: int = 0,
        shard_id: int = 0,
        num_shards: int = 1,
        file_filters: Sequence[str] = DEFAULT_FILE_FILTERS,
        case_sensitive_filter: bool = False,
        threads: int | None = None,
    ) -> None:
        args.check_epoch_source(batch_size, shuffle, seed, shard_id, num_shards)
        args.folder("root", root)
        args.backend(backend)
        args.patterns("file_filters", file_filters)
        args.flag("case_sensitive_filter", case_sensitive_filter)
        if threads is not None:
            args.count("threads", threads)
        self.root = Path(root)
        self.files = list_labeled_files(root, file_filters, case_sensitive_filter)
        if not self.files:
            raise ArgumentValueError(
                f"FileSource: no files under {self.root} match {list(file_filters)[:4]} in a class subfolder "
                "(root/<class>/<file>, one level, as fn.readers.file lists them); pass the folder of class folders"
            )
        super().__init__(len(self.files), batch_size, shuffle, seed, shard_id, num_shards)
        self.threads = threads if threads is not None else read_threads(os.cpu_count() or 1)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_size = 0
        self._own = not isinstance(backend, Backend)
        self.backend: Backend | None = None
        self._uring: uring.BatchReader | None = None
        self._sizes = np.full(len(self.files), -1, np.int64)  # each file's size when last read (-1: not yet)
        self._started_bytes = 0  # bytes of the last batch whose reads were submitted (bounds the depth)
        if isinstance(backend, Backend):
            self.backend = backend
        elif backend != "auto":
            self.backend = get_backend(backend)

    readahead = True
    cold_epochs = True

    def _reader(self) -> uring.BatchReader | None:
        """The auto backend's io_uring reader (None: plain reads, with threads and hints when cold)."""
        if self.backend is not None or not uring.available():
            return None
        if self._uring is None:
            self._uring = uring.BatchReader()
        return self._uring

    @property
    def _hints(self) -> bool:
        """WILLNEED hints only where reads are plain (io_uring reads of the batches ahead are in flight)."""
        return self.backend is None and self._reader() is None

    def _depth(self) -> int:
        """io_uring: up to URING_BATCHES batches in flight, at most URING_FILES files and about HINT_BYTES."""
        if self._reader() is None:
            return 1
        by_bytes = HINT_BYTES // max(1, self._started_bytes)
        return max(1, min(URING_BATCHES, URING_FILES // self.batch_size, by_bytes))

    def _start(self, positions: list[int]) -> Any:
        reader = self._reader()
        if reader is None or len(positions) > URING_FILES:
            return super()._start(positions)
        if self._consumer_idle():  # the opens and the submission go on the read-ahead thread, in order
            return _Reading(self, reader, self._pool_ahead().submit(self._uring_start, reader, positions), positions)
        batch = self._uring_start(reader, positions)
        return _Reading(self, reader, batch, positions)

    def _uring_start(self, reader: uring.BatchReader, positions: list[int]) -> Any:
        """Submit a batch's reads; where every file's size is known from an earlier read, the opens go
        through the ring too."""
        known = self._sizes[positions]
        batch = reader.start(self._paths(positions), known if bool((known >= 0).all()) else None)
        self._started_bytes = int(batch.size.sum())
        return batch

    def _waits(self, positions: list[int]) -> bool:
        """The first and the last file tell: hints are queued in order, and a batch half read in waits."""
        if self.backend is not None:
            return True
        ends = self._paths([positions[0], positions[-1]] if len(positions) > 1 else positions)
        return not all(_resident(p) for p in ends)

    def close(self) -> None:
        super().close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self._uring is not None:
            self._uring.close()
            self._uring = None
        if self._own and self.backend is not None:
            self.backend.close()

    def _paths(self, positions: list[int]) -> list[str]:
        root, files = str(self.root), self.files
        return [f"{root}/{files[i][0]}" for i in positions]

    def _hint(self, positions: list[int]) -> None:
        """Cold files of the batches after the one read ahead: WILLNEED, so the disk has them in flight."""
        paths = self._paths(positions)
        if self.backend is None and paths and not _resident(paths[0]):
            hint_files(paths)

    def _batch(self, positions: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
        paths = self._paths(positions)
        labels = _labels(self.files, positions)
        if self.backend is not None:
            return _read_files(self.backend, paths, [os.stat(p).st_size for p in paths]), labels
        data = self._read_plain(paths)
        self._sizes[positions] = [len(a) for a in data]  # later reads through the ring open without fstat
        return data, labels

    def _read_plain(self, paths: list[str]) -> list[np.ndarray]:
        threads = self.threads
        if len(paths) >= 8 and threads < COLD_READ_THREADS and not _resident(paths[0]):
            threads = COLD_READ_THREADS  # reads that wait on the disk hold no GIL: keep several in flight
        if len(paths) < 8 or threads == 1:
            return read_whole_files(paths)
        if self._pool is None or self._pool_size != threads:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool, self._pool_size = ThreadPoolExecutor(threads, thread_name_prefix="blockprep-files"), threads
        step = -(-len(paths) // threads)
        parts = [self._pool.submit(read_whole_files, paths[i : i + step]) for i in range(0, len(paths), step)]
        return [a for part in parts for a in part.result()]


class _Reading:
    """A FileSource batch whose io_uring reads are in flight, or being submitted on the read-ahead thread
    (`batch` a Future of it): `result()` waits, as a Future's."""

    def __init__(self, source: FileSource, reader: uring.BatchReader, batch: Any, positions: list[int]) -> None:
        self.source, self.reader, self.batch, self.positions = source, reader, batch, positions

    def result(self) -> tuple[list[np.ndarray], np.ndarray]:
        batch = self.batch.result() if isinstance(self.batch, Future) else self.batch
        data = self.reader.finish(batch)
        self.source._sizes[self.positions] = [len(a) for a in data]
        return data, _labels(self.source.files, self.positions)

    def exception(self) -> BaseException | None:
        """Wait for it and drop it (an epoch left early): its error, if any, belongs to nobody."""
        try:
            self.result()
        except Exception as exc:  # noqa: BLE001 - handed back, as Future.exception does
            return exc
        return None


class BmapSource(_EpochSource):
    """(bytes, label) batches of the files of a block map, read as raw device ranges.

    bmap: a bmap.json path, a flat research map, or a BlockMap. backend: "blockdev" (O_DIRECT on the device
    or loop image) or "xnvme" (the `xnvme-bmap` backend). folder: the class-folder root inside the map ("" =
    the map's root; default "" for bmap.json, "train" for flat maps, whose keys are "train/<class>/<file>").
    root: where the map's keys are mounted now (default: the map's own root; flat maps have none).
    backend_options: more arguments for the backend (e.g. {"be": "bam"} for xNVMe's BaM backend).

    Where that folder is mounted, files and labels are exactly `fn.readers.file(file_root=...)`'s (the same
    listing as `list_labeled_files`: empty class folders keep their label, DALI's filters, one level); files
    there that the map lacks are read through the filesystem (one warning). Only where nothing is mounted
    (a flat map without root) are labels derived from the keys, as the research loaders do.

    A batch that would wait on the disk (O_DIRECT reads always; a loop image's page cache that lacks it) is
    read ahead; an epoch that starts so keeps BMAP_COLD_BATCHES batches being read ahead."""

    def __init__(
        self,
        bmap: Any,
        backend: str = "blockdev",
        batch_size: int = 32,
        shuffle: bool = False,
        seed: int = 0,
        shard_id: int = 0,
        num_shards: int = 1,
        file_filters: Sequence[str] = DEFAULT_FILE_FILTERS,
        device_path: str | None = None,
        folder: str | None = None,
        root: str | os.PathLike[str] | None = None,
        backend_options: dict[str, Any] | None = None,
    ) -> None:
        from loaders.bmap import BlockMap

        _check_bmap_args(bmap, backend, file_filters, device_path, folder, root, backend_options)
        args.check_epoch_source(batch_size, shuffle, seed, shard_id, num_shards)
        self.bmap = bmap if isinstance(bmap, BlockMap) else BlockMap.load(bmap, root=root, device=device_path)
        if folder is None:
            folder = "train" if self.bmap.flat and all(k.startswith("train/") for k in self.bmap.files) else ""
        self.prefix = folder.strip("/") + "/" if folder.strip("/") else ""
        tree = Path(self.bmap.root) / self.prefix
        mounted = not (self.bmap.flat and not self.bmap.doc["root"]) and tree.is_dir()
        self.files = list_labeled_files(tree, file_filters) if mounted else self._from_keys(file_filters)
        if not self.files:
            raise ArgumentValueError(f"BmapSource: no files of {self.bmap.path} under folder={folder!r} "
                                     f"({tree}/<class>/<file>); {_folder_hint(self.bmap.files)}")  # fmt: skip
        # files of the folder the map does not know (added after mapping): through the filesystem
        self._unmapped = {p for p, _ in self.files if self.prefix + p not in self.bmap.files}
        if self._unmapped:
            warnings.warn(
                f"{tree}: {len(self._unmapped)} file(s) not in block map {self.bmap.path} (e.g. "
                f"{min(self._unmapped)}); reading them through the filesystem (re-run `prep bmap` to map them)",
                RuntimeWarning,
                stacklevel=2,
            )
        super().__init__(len(self.files), batch_size, shuffle, seed, shard_id, num_shards)
        mapped = [self.bmap.files[self.prefix + p]["size"] for p, _ in self.files if p not in self._unmapped]
        self._batch_bytes = batch_size * (sum(mapped) // max(1, len(mapped)))  # a batch's bytes, about
        name = "xnvme-bmap" if backend == "xnvme" else backend  # "xnvme" here means its block-range reader
        self.backend: Backend = get_backend(name, bmap=self.bmap, device_path=device_path, **(backend_options or {}))

    def _from_keys(self, file_filters: Sequence[str]) -> list[tuple[str, int]]:
        """(file, label) from the map's keys alone: a class is a subfolder holding mapped files (an empty
        folder cannot be seen in a map, so labels after it would differ from DALI's: only without a tree)."""
        under = [k[len(self.prefix) :] for k in self.bmap.files if k.startswith(self.prefix)]
        classes = sorted({k.split("/")[0] for k in under if "/" in k}, key=os.fsencode)
        rel = [k for k in under if k.count("/") == 1 and _matches(k.split("/")[1], file_filters, False)]
        label = {c: i for i, c in enumerate(classes)}
        return sorted(((k, label[k.split("/")[0]]) for k in rel), key=lambda kv: os.fsencode(kv[0]))

    readahead = True
    cold_epochs = True

    def _depth(self) -> int:
        """A cold epoch keeps BMAP_COLD_BATCHES batches being read, at most about HINT_BYTES."""
        return max(1, min(BMAP_COLD_BATCHES, HINT_BYTES // max(1, self._batch_bytes)))

    def _waits(self, positions: list[int]) -> bool:
        cached = getattr(self.backend, "cached", None)
        first = self.prefix + self.files[positions[0]][0]
        return cached is None or first not in self.bmap.files or not cached(first)

    def close(self) -> None:
        super().close()
        self.backend.close()

    def _batch(self, positions: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
        files, prefix, unmapped = self.files, self.prefix, self._unmapped
        rels = [files[i][0] for i in positions]
        keys = [prefix + r for r in rels if r not in unmapped]
        records = self.bmap.files  # the raw records: a FileEntry per file only for its size costs microseconds
        read = iter(_read_files(self.backend, keys, [records[k]["size"] for k in keys]) if keys else [])
        changed = getattr(self.backend, "changed", None)
        stale = changed(keys) if changed is not None else ()
        if not unmapped and not stale:
            return list(read), _labels(files, positions)
        data = []
        for r in rels:
            k = prefix + r
            if r in unmapped or k in stale:
                if r not in unmapped:
                    next(read)  # its raw bytes are not used: the size may have changed too, read it whole now
                data.append(np.fromfile(self.bmap.file_path(k), dtype=np.uint8))
            else:
                data.append(next(read))
        return data, _labels(files, positions)


def _check_bmap_args(
    bmap: Any, backend: Any, file_filters: Any, device_path: Any, folder: Any, root: Any, backend_options: Any
) -> None:
    """BmapSource's own arguments, before the map is loaded."""
    from loaders.bmap import BlockMap

    if not isinstance(bmap, BlockMap):
        args.path("bmap", bmap)
    if not isinstance(backend, str) or ("xnvme-bmap" if backend == "xnvme" else backend) not in BLOCK_RANGE_BACKENDS:
        raise BackendError(f"BmapSource: backend {backend!r} cannot read block ranges; use 'blockdev' or 'xnvme'")
    args.patterns("file_filters", file_filters)
    args.path("device_path", device_path, allow_none=True)
    args.path("root", root, allow_none=True)
    args.options("backend_options", backend_options)
    if folder is not None and not isinstance(folder, str):
        raise ArgumentTypeError(f"folder={folder!r} is not a folder name inside the map (e.g. 'train')")


def _folder_hint(keys: Any) -> str:
    """Where a map's class folders are: the folder its keys most often sit two levels under."""
    from collections import Counter

    parents = Counter(k.rsplit("/", 2)[0] if k.count("/") >= 2 else "" for k in keys if "/" in k)
    if not parents:
        return "the map lists no file inside a class folder"
    best = parents.most_common(1)[0][0]
    return f"its class folders are under {best!r}: pass folder={best!r}"


class CacheSource(_EpochSource):
    """Prepared-cache tensors, batch mode: one dense (B, ...) array per key (a list when shapes differ).

    device="cpu": numpy arrays (zero-copy views of the read buffers). device="cuda:N": CUDA torch tensors
    (kvikio straight to the GPU, else pinned staging); give `fn.external_source(device="gpu")`."""

    def __init__(
        self,
        cache_dir: str | os.PathLike[str],
        keys: str | Sequence[str] = "image",
        batch_size: int = 8,
        backend: str | Backend = "auto",
        device: str = "cpu",
        shuffle: bool = False,
        seed: int = 0,
        shard_id: int = 0,
        num_shards: int = 1,
        prefetch: int = 2,
    ) -> None:
        from loaders.dataset import PreparedDataset

        args.check_epoch_source(batch_size, shuffle, seed, shard_id, num_shards)
        args.count("prefetch", prefetch, 0)
        args.cache_dir(cache_dir)
        if keys is None:
            raise ArgumentTypeError("keys=None: CacheSource gives one output per key; name them (e.g. 'image')")
        wanted = [keys] if isinstance(keys, str) else keys
        self.dataset = PreparedDataset(cache_dir, keys=wanted, backend=backend, device=device, meta=False)
        self.keys: list[str] = list(self.dataset.keys)
        super().__init__(len(self.dataset), batch_size, shuffle, seed, shard_id, num_shards)
        self.prefetch = prefetch
        self._batches: Iterator[dict[str, Any]] | None = None

    def __iter__(self) -> Any:
        super().__iter__()
        view = self.dataset.subset(self._order)  # this epoch's order (shard and shuffle applied)
        self._batches = view.iter_batches(self.batch_size, prefetch=self.prefetch)
        return self

    def __next__(self) -> Any:
        if self._batches is None:
            iter(self)
        assert self._batches is not None
        batch = next(self._batches)  # StopIteration ends the epoch
        outs = [self._out(batch[k]) for k in self.keys]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def close(self) -> None:
        self.dataset.close()

    def _out(self, value: Any) -> Any:
        if self.dataset.on_gpu:
            return value
        if isinstance(value, list):
            return [v.numpy() for v in value]
        return value.numpy()
