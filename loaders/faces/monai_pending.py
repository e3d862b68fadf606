"""The drop-in over a folder that holds no prepared cache yet and nothing else: a pending prepared cache.

`PreparedPersistentDataset(data, transform, cache_dir)` where `cache_dir` does not exist or is empty (MONAI's
`PersistentDataset.__init__` makes it) writes a pending marker there (`loaders.cache.pending`: the head's
fingerprint, its transforms, library versions, the Compose options, the datalist section), then serves every
item as it serves an entry a committed cache lacks: a drop-in record of it (`loaders.faces.monai_fill`) read
back where one is there, else computed by MONAI's own `PersistentDataset` and written as such a record. `prep
cache` over that folder with the same head commits it, taking the records (`prep.cache_plan.adopt`).

A folder that holds anything else (MONAI's `<hash>.pt` files, a user's files) is not one: `PersistentDataset`'s
own code runs there, as before.
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from loaders.cache import chain
from loaders.cache.pending import FIX, pending_doc, read_pending, write_pending
from loaders.cache.spec import MANIFEST, PENDING
from loaders.errors import PrepError
from loaders.faces.dataset import read_record
from loaders.faces.monai_fill import Fill

__all__ = ["SECTION", "is_pending", "pending_fill", "record_reader"]

SECTION = "training"  # the datalist section a pending cache's records name (`prep cache`'s default section)
_MAKING = f".{PENDING}.tmp."  # the marker's temp file (`loaders.cache.writing.atomic_write_bytes`) while written
_VERSIONS_FIX = f"made under other libraries; {FIX}"


def is_pending(cache_dir: Any) -> bool:
    """True where `cache_dir` is a folder without a manifest that holds a pending marker, or nothing (but the
    marker another process is writing): a new or empty folder, where the drop-in starts a pending cache."""
    root = Path(cache_dir)
    try:
        names = os.listdir(root)
    except OSError:  # not a folder (PersistentDataset's own checks say so), or unreadable
        return False
    return MANIFEST not in names and (PENDING in names or all(n.startswith(_MAKING) for n in names))


def pending_fill(root: Path, transform: Any, head: list[Any]) -> Fill:
    """The drop-in records of the pending cache at `root` for `transform` (whose head is `head`): its marker
    checked (StaleError for another head or library versions, FormatError for a file that is no marker), or
    written where there is none yet. Where it cannot be written, a RuntimeWarning says so once and the Fill
    writes nothing: every item is computed at each read, as PersistentDataset(cache_dir=None) computes it."""
    marker = read_pending(root)
    where = str(root / PENDING)
    if marker is not None:
        chain.check_fingerprint(transform, marker, where, (FIX, _VERSIONS_FIX))
        return Fill(root, marker["fingerprint"], marker["section"])
    options = chain.compose_options(transform)
    fingerprint = chain.fingerprint(head, options)
    doc = pending_doc(fingerprint, chain.describe(head), chain.versions(), options, SECTION)
    try:
        write_pending(root, doc)
    except (OSError, PrepError) as exc:
        warnings.warn(
            f"{root}: cannot start a prepared cache here ({type(exc).__name__}: {str(exc)[:200]}); every item is "
            "computed at each read; make the folder writable or pass another cache_dir",
            RuntimeWarning,
            stacklevel=4,
        )
        return Fill(root, fingerprint, SECTION, writes=False)
    return Fill(root, fingerprint, SECTION)


def record_reader(
    device: str, meta: bool, leaf_types: bool, keys: Any
) -> Callable[[dict[str, Any], dict[str, Any]], Any]:
    """How a pending cache's record becomes the head's output (`loaders.faces.dataset.read_record`: as a
    committed item is read, with the drop-in's device, meta and leaf types); picklable for DataLoader workers."""
    return functools.partial(
        read_record, device=device, meta=meta, leaf_types=leaf_types, keys=None if keys is None else list(keys)
    )
