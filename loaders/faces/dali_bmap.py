"""DALI face, block maps: `BmapSource`, the files of a block map read as raw device ranges for
`fn.external_source` (`from loaders.faces.dali import BmapSource`; the other sources are in `loaders.faces.dali`)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from loaders import args
from loaders.backends import BLOCK_RANGE_BACKENDS, Backend, get_backend
from loaders.errors import ArgumentTypeError, ArgumentValueError, BackendError, UnsafeFileError
from loaders.faces.dali_base import (
    DEFAULT_FILE_FILTERS,
    _EpochSource,
    _labels,
    _matches,
    _read_files,
    list_labeled_files,
)
from loaders.reading.files import HINT_BYTES, cached_whole, read_whole_files
from loaders.tunables import BMAP_COLD_BATCHES, BMAP_COLD_THREADS, MEMORY_PROBES_AFTER_MISS


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

    A batch whose first and last files sit whole in the filesystem's page cache (cachestat, no I/O) is read
    through the filesystem: from memory, exact by construction, where a raw read would go to the device (O_DIRECT)
    and check each file again on a writable mount (`MappedFiles.refresh`: one lstat a file). A batch that
    would wait on the disk (O_DIRECT reads always; a loop image's page cache that lacks it) is read raw, ahead;
    an epoch that starts so keeps BMAP_COLD_BATCHES batches being read ahead, raw, two at once
    (BMAP_COLD_THREADS), with no probe (opening two cold files a batch to ask the page cache slowed the cold
    epoch: docs/benchmarks.md, DALI sources)."""

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
        from loaders.blockmap.bmap import BlockMap

        _check_bmap_args(bmap, backend, file_filters, device_path, folder, root, backend_options)
        args.check_epoch_source(batch_size, shuffle, seed, shard_id, num_shards)
        self.bmap = bmap if isinstance(bmap, BlockMap) else BlockMap.load(bmap, root=root, device=device_path)
        if folder is None:
            folder = "train" if self.bmap.flat and all(k.startswith("train/") for k in self.bmap.files) else ""
        self.prefix = folder.strip("/") + "/" if folder.strip("/") else ""
        tree = Path(self.bmap.root) / self.prefix
        mounted = not (self.bmap.flat and not self.bmap.doc["root"]) and tree.is_dir()
        if mounted:
            _no_link_to(self.bmap.root, self.prefix)
        # no symlinked class folder or file is listed (or read): nothing outside the map's root
        self.files = (
            list_labeled_files(tree, file_filters, follow_links=False) if mounted else self._from_keys(file_filters)
        )
        self._tree = str(tree) if mounted else None  # where the files are read through the filesystem
        self._misses = 0  # batches since the page cache was last found without a batch (0: ask next time)
        self._asked: tuple[int, int, bool] | None = None  # (first, last position, in memory) of the last answer
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

    def _pool_ahead(self) -> ThreadPoolExecutor:
        """BMAP_COLD_THREADS threads where the backend takes reads from several threads at once (`blockdev`, its
        pools made first), else one."""
        if self._ahead_pool is None:
            ready = getattr(self.backend, "ready_for_threads", None)
            if ready is not None:
                ready()
            threads = BMAP_COLD_THREADS if ready is not None else 1
            self._ahead_pool = ThreadPoolExecutor(threads, thread_name_prefix="blockprep-readahead")
        return self._ahead_pool

    def _in_memory(self, positions: list[int]) -> bool:
        """Whether the filesystem's page cache holds the batch: its first and last files, whole."""
        if self._tree is None:
            return False
        ends = (positions[0], positions[-1])
        last = self._asked
        if last is not None and last[:2] == ends:  # planned ahead (`_waits`), then read (`_batch`): asked once
            self._asked = None  # an answer serves one read: a later epoch asks again
            return last[2]
        if self._misses % MEMORY_PROBES_AFTER_MISS:  # cold data: opening files to ask costs milliseconds
            self._misses += 1
            return False
        hit = all(cached_whole(f"{self._tree}/{self.files[i][0]}") for i in dict.fromkeys(ends))
        self._misses = 0 if hit else 1
        self._asked = (*ends, hit)
        return hit

    def _waits(self, positions: list[int]) -> bool:
        if self._in_memory(positions):
            return False
        cached = getattr(self.backend, "cached", None)
        first = self.prefix + self.files[positions[0]][0]
        return cached is None or first not in self.bmap.files or not cached(first)

    def close(self) -> None:
        super().close()
        self.backend.close()

    def _batch(self, positions: list[int]) -> tuple[list[np.ndarray], np.ndarray]:
        files, prefix, unmapped = self.files, self.prefix, self._unmapped
        if not self._cold_epoch and self._in_memory(positions):  # a cold epoch reads raw, with no probe
            self._check_first([prefix + files[i][0] for i in positions if files[i][0] not in unmapped])
            whole = read_whole_files([prefix + files[i][0] for i in positions], root=self.bmap.root)
            return whole, _labels(files, positions)
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
                data.append(read_whole_files([k], root=self.bmap.root)[0])  # below the root, no link followed
            else:
                data.append(next(read))
        return data, _labels(files, positions)

    def _check_first(self, keys: list[str]) -> None:
        """The once-per-file check of a raw read (open, fstat, FIEMAP) for files read from memory first, so that
        a later raw read of them needs only the recheck (the cost stays where a first read is)."""
        guard = getattr(self.backend, "guard", None)
        if guard is not None:
            why = guard.why
            unchecked = [k for k in keys if k not in why]
            if unchecked:
                guard.check_many(unchecked)


def _check_bmap_args(
    bmap: Any, backend: Any, file_filters: Any, device_path: Any, folder: Any, root: Any, backend_options: Any
) -> None:
    """BmapSource's own arguments, before the map is loaded."""
    from loaders.blockmap.bmap import BlockMap

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


def _no_link_to(root: str, prefix: str) -> None:
    """UnsafeFileError when a folder of `prefix` below `root` is a symlink (its files would lie elsewhere)."""
    at = root
    for part in [p for p in prefix.split("/") if p]:
        at = os.path.join(at, part)
        if os.path.islink(at):
            raise UnsafeFileError(f"{at}: is a symlink, where a folder of the block map's root {root} belongs; "
                                  "refused (links are never followed); pass the real folder")  # fmt: skip


def _folder_hint(keys: Any) -> str:
    """Where a map's class folders are: the folder its keys most often sit two levels under."""
    from collections import Counter

    parents = Counter(k.rsplit("/", 2)[0] if k.count("/") >= 2 else "" for k in keys if "/" in k)
    if not parents:
        return "the map lists no file inside a class folder"
    best = parents.most_common(1)[0][0]
    return f"its class folders are under {best!r}: pass folder={best!r}"
