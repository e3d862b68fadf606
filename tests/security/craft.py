"""Crafting caches as an attacker would: edit a layout file, then recompute every checksum the manifest holds
(file records and the document checksum), so checksums cannot be what refuses the edit."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from loaders.cache.checksums import doc_checksum, file_record
from loaders.cache.spec import LAYOUT_FILES, MANIFEST


def copy_cache(good: Path, where: Path) -> Path:
    """A copy of a good cache to edit."""
    shutil.copytree(good, where)
    return where


def reseal(root: Path, edit_manifest: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Recompute the manifest's file records and its own checksum after an edit (optionally editing it too)."""
    path = root / MANIFEST
    doc = json.loads(path.read_text())
    if edit_manifest is not None:
        edit_manifest(doc)
    doc["files"] = {name: file_record(root / name) for name in LAYOUT_FILES}
    doc["checksum"] = doc_checksum(doc)
    path.write_text(json.dumps(doc))


def rewrite_meta(root: Path, edit: Callable[[int, dict[str, Any]], dict[str, Any] | str]) -> None:
    """Rewrite meta.jsonl line by line (edit(item, line) -> new line or raw text) and its offsets; reseal."""
    lines = (root / "meta.jsonl").read_bytes().splitlines(keepends=False)
    out, offsets, pos = [], [], 0
    for i, raw in enumerate(lines):
        new = edit(i, json.loads(raw))
        data = (new if isinstance(new, str) else json.dumps(new)).encode() + b"\n"
        offsets.append(pos)
        out.append(data)
        pos += len(data)
    (root / "meta.jsonl").write_bytes(b"".join(out))
    np.save(root / "meta_offsets.npy", np.asarray(offsets, dtype=np.uint64))
    reseal(root)


def edit_index(root: Path, edit: Callable[[np.ndarray], None]) -> None:
    """Edit index.npy's rows in place (edit(rows)), then reseal."""
    rows = np.load(root / "index.npy", allow_pickle=False).copy()
    edit(rows)
    np.save(root / "index.npy", rows, allow_pickle=False)
    reseal(root)
