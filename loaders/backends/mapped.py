"""The one stale-file rule of every block-range reader (`blockdev`, `xnvme-bmap`): which files of a block map
may be read raw, decided once per file per backend, and the filesystem read for the others.

A file is read through the filesystem instead of raw, with one warning per file (or BackendError when
`fallback=False`), when its entry is not raw-readable (inline, unwritten, ... extents) or when it changed
since it was mapped (size, inode or mtime differ, or it is gone).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Iterable
from typing import Any

from loaders.backends.base import FdCache, ReadRequest, pread_full, short_read
from loaders.bmap import BlockMap
from loaders.errors import BackendError

UNCHECKED = "?"  # verdict of a file whose check has not run (or is still running)


class MappedFiles:
    """Per-file verdicts for one backend: `why[key]` is None (read raw), a reason (read through the
    filesystem), or absent (not checked yet). `check_stale=False` trusts the map's freshness (read-only data)."""

    def __init__(self, bmap: BlockMap, fallback: bool = True, check_stale: bool = True) -> None:
        self.bmap = bmap
        self.fallback = fallback
        self.check_stale = check_stale
        self.why: dict[str, str | None] = {}
        self._warned: set[str] = set()
        self._lock = threading.Lock()
        self._fs = FdCache(os.O_RDONLY)

    def reason(self, key: str) -> str | None:
        """Why `key` must be read through the filesystem (None: raw), checked on first use."""
        why = self.why.get(key, UNCHECKED)
        if why == UNCHECKED:
            why = self._verdict(key)
            self.why[key] = why
        return why

    def _verdict(self, key: str) -> str | None:
        e = self.bmap.entry(key)
        if not e.raw_readable:
            return f"not raw-readable ({e.reason})"
        if not self.check_stale:
            return None
        stale = self.bmap.stale_reason(key)
        return f"changed since it was mapped ({stale})" if stale else None

    def check_many(self, keys: Iterable[str]) -> None:
        """Verdicts of `keys` (one stat each when unchanged: the lean form of `reason`, for batches)."""
        files, root, stat_ = self.bmap.files, self.bmap.root + "/", os.stat
        for k in keys:
            r = files[k]
            if not r["raw_readable"] or not self.check_stale:
                self.reason(k)
                continue
            try:
                st = stat_(root + k)
                same = st.st_size == r["size"] and st.st_ino == r["inode"] and st.st_mtime_ns == r["mtime_ns"]
            except OSError:
                same = False
            self.why[k] = None if same else self._verdict(k)

    def changed(self, key: str) -> bool:
        """Whether the file was found changed since mapping (False until checked)."""
        return (self.why.get(key) or "").startswith("changed")

    def fs_read(self, key: str, why: str, req: ReadRequest, buf: memoryview) -> None:
        """Read `req` through the filesystem into `buf` (warning once per file), or raise without fallback."""
        path = self.bmap.file_path(key)
        if not self.fallback:
            raise BackendError(f"{path}: {why}; re-run `prep bmap` or allow fallback=True")
        with self._lock:
            first = key not in self._warned
            self._warned.add(key)
        if first:
            warnings.warn(f"{path}: {why}; reading it through the filesystem", RuntimeWarning, stacklevel=5)
        got = pread_full(self._fs.get(path), buf, req.offset, path)
        if got < req.nbytes:
            raise short_read(req, got)

    def close(self) -> None:
        """Close the descriptors of filesystem reads."""
        self._fs.close()

    def __getstate__(self) -> dict[str, Any]:
        # verdicts travel to worker processes; locks and descriptors are rebuilt there
        return {k: v for k, v in self.__dict__.items() if k not in ("_lock", "_fs")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()
        self._fs = FdCache(os.O_RDONLY)
