"""`prep sampling`: the sampling sets of a label-driven crop (`loaders.cache.sampling`), made from a committed cache.

`prep cache` calls `ensure_sets` after it commits, so a cache made for a chain whose tail starts with
`RandCropByPosNegLabeld` or `RandCropByLabelClassesd` has them; `prep sampling CACHE --pipeline P` adds them to
a cache made before (the head is not run again: the sets come from the cached label, as the tail sees it).
"""

from __future__ import annotations

import os
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from loaders.cache import sampling
from loaders.cache.format import PreparedCache
from loaders.fast.folds import crop_sets_of
from loaders.opener import folder_to_write, open_to_write

_FIX = "remove it, or choose another --output"


def ensure_sets(cache_dir: str | Path, tail: list[Any], workers: int = 2, force: bool = False) -> str:
    """Make the sets the tail's label-driven crop draws from, unless current ones exist; a line saying what
    was done ("" when the tail starts with no such crop)."""
    sig = crop_sets_of(tail)
    if sig is None:
        return ""
    cache = PreparedCache(cache_dir)
    if not force:
        try:
            if sampling.open_store(cache, sig) is not None:
                return f"sampling sets: current ({type(tail[0]).__name__})"
        except Exception:  # noqa: BLE001  (a damaged or stale set is remade)
            pass
    t0 = time.perf_counter()
    keys = [sig["label_key"]] + ([sig["image_key"]] if sig["image_key"] else [])
    missing = [k for k in keys if k not in cache.keys]
    if missing:
        return f"sampling sets: not made, the cache has no key {missing[0]!r} (it has {cache.keys})"
    from loaders import PreparedDataset

    ds = PreparedDataset(cache.root, keys=keys, meta=False)

    def sets_of(item: int) -> sampling.Packed:
        got = ds[item]
        return sampling.packed_sets(sig, got[sig["label_key"]], got.get(sig["image_key"]) if sig["image_key"] else None)

    try:
        where = sampling.write_sets(cache.root, sig, sets_of, len(cache), str(cache.generation), workers)
    finally:
        ds.close()  # its backend's open shards would keep the cache's filesystem busy
    return (
        f"sampling sets: {len(cache)} items for {type(tail[0]).__name__} in {time.perf_counter() - t0:.1f} s "
        f"({where.relative_to(cache.root)})"
    )


class WorkerSets:
    """The sampling sets `prep cache`'s workers made beside each item (`TaskSpec.sets`), kept in a file of
    the cache's sampling folder as their tasks finish (memory stays bounded), then written as the cache's
    sets after the commit, in its item order, without reading a label back. `add` takes a task's statuses."""

    def __init__(self, root: Path, sig: dict[str, Any]) -> None:
        import threading
        import uuid

        self.root, self.sig = Path(root), sig
        self.path = self.root / sampling.DIR / f".worker-sets-{uuid.uuid4().hex[:8]}.bin"
        self._dir = folder_to_write(self.root, sampling.DIR, _FIX)  # held: a swap of sampling/ redirects nothing
        for stale in os.listdir(self._dir):  # a killed run's (the cache lock is held)
            if stale.startswith(".worker-sets-") and stale.endswith(".bin"):
                os.unlink(stale, dir_fd=self._dir)
        fd = open_to_write(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, _FIX, dir_fd=self._dir)
        self._file = os.fdopen(fd, "w+b")  # closed by close()
        self._at: dict[int, tuple[int, list[tuple[int, int, int]]]] = {}  # item -> (offset, (nvox, nbytes, count))
        self._lock = threading.Lock()

    def add(self, statuses: list[dict[str, Any]]) -> None:
        with self._lock:
            for s in statuses:
                sets = s.get("sets")
                if sets is None:
                    continue
                at = self._file.seek(0, os.SEEK_END)
                for _, data, _ in sets:
                    self._file.write(data)
                self._at[int(s["item"])] = (at, [(int(n), len(d), int(c)) for n, d, c in sets])

    def _made(self, item: int) -> sampling.Packed:
        at, rows = self._at[item]
        with self._lock:
            self._file.seek(at)
            return [(n, self._file.read(k), c) for n, k, c in rows]

    def write(self, order: list[int], tail: list[Any]) -> str:
        """The summary line of the sets written for the committed items `order` (plan numbers, in the cache's
        item order); "" where a worker did not make an item's sets (a resumed run: the pass after the commit
        makes them from the cache)."""
        if not order or any(i not in self._at for i in order):
            return ""
        t0 = time.perf_counter()
        self._file.flush()
        cache = PreparedCache(self.root)
        where = sampling.write_sets(self.root, self.sig, lambda n: self._made(order[n]), len(order),
                                    str(cache.generation), 1)  # fmt: skip
        return (
            f"sampling sets: {len(order)} items for {type(tail[0]).__name__}, made by the workers, written in "
            f"{time.perf_counter() - t0:.1f} s ({where.relative_to(self.root)})"
        )

    def close(self) -> None:
        self._file.close()
        with suppress(FileNotFoundError):
            os.unlink(self.path.name, dir_fd=self._dir)
        os.close(self._dir)
