"""`prep sampling`: the sampling sets of a label-driven crop (`loaders.sampling`), made from a committed cache.

`prep cache` calls `ensure_sets` after it commits, so a cache made for a chain whose tail starts with
`RandCropByPosNegLabeld` or `RandCropByLabelClassesd` has them; `prep sampling CACHE --pipeline P` adds them to
a cache made before (the head is not run again: the sets come from the cached label, as the tail sees it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from loaders import sampling
from loaders.folds import crop_sets_of
from loaders.format import PreparedCache


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
    from loaders.dataset import PreparedDataset

    ds = PreparedDataset(cache.root, keys=keys, meta=False)

    def read(item: int) -> tuple[Any, Any]:
        got = ds[item]
        return got[sig["label_key"]], got.get(sig["image_key"]) if sig["image_key"] else None

    try:
        where = sampling.write_sets(cache.root, sig, read, len(cache), str(cache.generation), workers)
    finally:
        ds.close()  # its backend's open shards would keep the cache's filesystem busy
    return (
        f"sampling sets: {len(cache)} items for {type(tail[0]).__name__} in {time.perf_counter() - t0:.1f} s "
        f"({where.relative_to(cache.root)})"
    )
