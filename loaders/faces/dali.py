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

import os
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from loaders import args
from loaders.backends import Backend, check_backend, get_backend
from loaders.errors import ArgumentTypeError, ArgumentValueError
from loaders.faces.dali_base import (
    DEFAULT_FILE_FILTERS,
    _EpochSource,
    _labels,
    _read_files,
    list_labeled_files,
)
from loaders.faces.dali_bmap import BMAP_COLD_BATCHES, BMAP_COLD_THREADS, BmapSource
from loaders.reading import uring
from loaders.reading.files import HINT_BYTES, _resident, hint_files, read_whole_files
from loaders.tunables import COLD_READ_THREADS, URING_BATCHES, URING_FILES


def read_threads(cores: int) -> int:
    """FileSource's read threads for warm batches: one, whatever the cores. Reading holds the GIL for its
    per-file Python, and each thread waits for it again after every syscall: more threads were slower on 2 cores
    and on 16 (docs/benchmarks.md, DALI sources). `cores` is kept for callers that pass it."""
    return 1


class FileSource(_EpochSource):
    """(encoded bytes, label) batches of a class-folder tree, read through `backend`.

    Yields ([uint8 arrays], a (B, 1) int32 array: B labels of shape (1,)) like `fn.readers.file`'s two
    outputs; use
    `fn.external_source(source=src, num_outputs=2, batch=True)`. `files` holds the (path, label) list.

    backend "auto" (default): whole files through the page cache. Batches read when asked for (warm ones)
    are read on `threads` threads (`threads=None`: `read_threads(os.cpu_count())`, one). In a cold epoch,
    where io_uring can be used (`loaders.reading.uring.available()`), 4 batches are kept in flight, each batch's
    reads submitted together, so the kernel merges the reads of files that lie next to each other on the
    disk (docs/benchmarks.md, DALI sources); elsewhere a cold
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
        check_backend(backend)
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
        from loaders.faces.torch_data import PreparedDataset

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


__all__ = [
    "BMAP_COLD_BATCHES", "BMAP_COLD_THREADS", "DEFAULT_FILE_FILTERS", "BmapSource", "CacheSource", "FileSource",
    "list_labeled_files", "read_threads",
]  # fmt: skip
