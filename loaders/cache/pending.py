"""The pending marker, both directions: `pending.json` in a folder where the MONAI drop-in started a prepared
cache before any `prep cache` run (a new or empty `cache_dir`). It names the head the drop-in's records were
computed with: every later process of the drop-in, and `prep cache` when it commits the folder, check their own
head against it (`loaders.cache.chain.check_fingerprint`). A folder with a manifest is a committed cache,
whatever marker it still holds (the commit removes the marker after writing the manifest).

The marker is untrusted input like every file of a cache: read through `loaders.opener` (no link followed, no
FIFO opened blocking, at most MAX_PENDING bytes), and one that is not a marker of this format is a one-line
FormatError.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loaders.cache.nesting import to_jsonable
from loaders.cache.spec import MAX_PENDING, PENDING, SCHEMA_VERSION
from loaders.cache.writing import atomic_write_bytes
from loaders.errors import FormatError
from loaders.opener import read_in

__all__ = ["FORMAT", "pending_doc", "read_pending", "write_pending"]

FORMAT = "blockprep-pending-cache"
FIX = "pass another cache_dir, or remove this folder to start it again"


def pending_doc(
    fingerprint: str, head: list[str], versions: Mapping[str, str], options: Mapping[str, Any], section: str
) -> dict[str, Any]:
    """The marker of a pending cache whose head has `fingerprint` (`head`: its transforms described, as a
    manifest's "head"), made under `versions` with the Compose `options`; records name datalist `section`."""
    return {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "fingerprint": fingerprint,
        "head": list(head),
        "versions": dict(versions),
        "compose_options": to_jsonable(dict(options)),
        "section": section,
    }


def write_pending(root: Path, doc: dict[str, Any]) -> None:
    """Write the marker into the folder `root` atomically (temp file, fsync, rename, fsync the folder), the
    names taken relative to the folder's descriptor (no link below it followed)."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        atomic_write_bytes(Path(root) / PENDING, json.dumps(doc, indent=1).encode(), dir_fd=fd)
    finally:
        os.close(fd)


def read_pending(root: Path) -> dict[str, Any] | None:
    """The marker of the pending cache at `root`; None where there is none; FormatError (one line naming the
    file and the fix) where it is not a readable marker of this format (`loaders.opener` refusals included)."""
    where = os.path.join(os.fspath(root), PENDING)
    try:
        raw = read_in(root, PENDING, FIX, MAX_PENDING)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise FormatError(f"{where}: unreadable ({exc.strerror or exc}); {FIX}") from None
    try:
        doc = json.loads(raw)
    except (ValueError, RecursionError):
        doc = None
    why = _malformed(doc)
    if why:
        raise FormatError(f"{where}: not a pending cache marker of blockprep ({why}); {FIX}")
    assert isinstance(doc, dict)
    return doc


def _malformed(doc: Any) -> str:
    """Why `doc` is not a marker this release reads ("" where it is)."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        return "no JSON object of this format"
    version = doc.get("schema_version")
    if not isinstance(version, str) or version.split(".")[0] != SCHEMA_VERSION.split(".")[0]:
        return f"schema {str(version)[:20]}, this release reads {SCHEMA_VERSION}"
    if not isinstance(doc.get("fingerprint"), str) or not isinstance(doc.get("section"), str):
        return "no fingerprint or section"
    head, versions = doc.get("head"), doc.get("versions")
    if not isinstance(head, list) or not all(isinstance(h, str) for h in head):
        return "its head is no list of names"
    if not isinstance(versions, dict) or not all(isinstance(v, str) for v in versions.values()):
        return "its versions are no names"
    return ""
