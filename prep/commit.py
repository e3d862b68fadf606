"""The commit of `prep cache`: journals -> index.npy + meta.jsonl, the shards trimmed and mapped, manifest.json last.

A cache is trusted only once its manifest is written (loaders.cache.format); everything before it can be redone.
"""

from __future__ import annotations

import json
import os
import shutil
from contextlib import suppress
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from loaders.cache import chain
from loaders.cache.spec import BMAP, JOURNAL_DIR, MANIFEST, PENDING, SHARD_DIR, align_up
from loaders.cache.writing import make_rows, write_index, write_manifest, write_meta
from loaders.opener import open_to_write
from prep.bricks import drop_bricks
from prep.errors import PrepError
from prep.journal import JournalState
from prep.outdirs import OutputDirs
from prep.pipeline import Pipeline

_FIX = "remove it, or choose another --output (prep cache never writes through a link)"


def commit(
    root: Path, plan: dict[str, Any], pipe: Pipeline, items: list[tuple[str, dict[str, Any]]], state: JournalState,
    dirs: OutputDirs | None = None,
) -> tuple[dict[str, Any], str]:  # fmt: skip
    """Consolidate journals into index.npy + meta.jsonl, map the shards, write manifest.json last (with every
    file's checksum), drop the journals. Returns the manifest and why no block map was written ("" if one was).
    `dirs`: the run's folders held open; shards are trimmed and removed, journals removed, relative to them."""
    for stale_tmp in root.glob(".*.tmp*"):  # temp files of a commit that ran out of space or was killed
        stale_tmp.unlink()
    order = state.order(len(items))
    records = [state.done[i] for i in order]
    keys = sorted({t["key"] for r in records for t in r["tensors"]})
    shards = sorted({r["shard"] for r in records})
    trim_shards(root, records, set(shards), dirs)
    key_pos = {k: n for n, k in enumerate(keys)}
    shard_pos = {s: n for n, s in enumerate(shards)}
    rows = [
        {**t, "item": n, "key": key_pos[t["key"]], "shard": shard_pos[r["shard"]]}
        for n, r in enumerate(records)
        for t in r["tensors"]
    ]
    write_index(root, make_rows(rows))
    write_meta(root, [r["meta"] for r in records], parsed=True)  # journal lines, parsed by read_journals
    (root / BMAP).unlink(missing_ok=True)  # a map of an earlier commit's shards
    drop_bricks(root)  # and blocks of its tensors
    _, bmap_note = write_bmap(root)  # before the manifest: a committed cache has its map (where FIEMAP works)
    quarantined = [
        {"item": i, "source": items[i][1], "path": q.get("path", ""), "reason": q["quarantined"],
         **{k: q[k] for k in ("inputs", "max_item_bytes") if k in q}}  # what a rerun checks (to_retry)
        for i, q in sorted(state.quarantined.items())
    ]  # fmt: skip
    manifest = {
        **plan,
        "tail": pipe.tail_description,
        "head_length": len(pipe.head),
        "head_device": chain.head_device(pipe.head),  # where the head left its tensors (None: the CPU)
        "keys": keys,
        "shards": shards,
        "n_items": len(records),
        "tensor_bytes": sum(int(t["nbytes"]) for r in records for t in r["tensors"]),
        "quarantined": quarantined,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
    write_manifest(root, manifest)
    # then a pending cache's marker (loaders.cache.pending): a reader takes the manifest over any marker
    if dirs is None:
        shutil.rmtree(root / JOURNAL_DIR, ignore_errors=True)
        (root / PENDING).unlink(missing_ok=True)
    else:
        _drop_journals(dirs)
        with suppress(FileNotFoundError):
            os.unlink(PENDING, dir_fd=dirs.fd())
    return json.loads((root / MANIFEST).read_text()), bmap_note


def trim_shards(root: Path, records: list[dict[str, Any]], used: set[str], dirs: OutputDirs | None = None) -> None:
    """Cut each shard after its last trusted tensor (a killed writer leaves preallocation); drop orphans. `dirs`:
    the run's folders held open (shards are opened, without following links, and removed relative to them)."""
    ends: dict[str, int] = {}
    for r in records:
        for t in r["tensors"]:
            ends[r["shard"]] = max(ends.get(r["shard"], 0), int(t["offset"]) + align_up(int(t["nbytes"])))
    folder = os.open(root / SHARD_DIR, os.O_RDONLY | os.O_DIRECTORY) if dirs is None else dirs.fd(SHARD_DIR)
    try:
        for shard in used:
            fd = open_to_write(root / shard, os.O_WRONLY, _FIX, dir_fd=folder)
            try:
                if os.fstat(fd).st_size != ends.get(shard, 0):
                    os.ftruncate(fd, ends.get(shard, 0))
            finally:
                os.close(fd)
        for name in os.listdir(folder):
            if f"{SHARD_DIR}/{name}" not in used:
                os.unlink(name, dir_fd=folder)
    finally:
        if dirs is None:
            os.close(folder)


def _drop_journals(dirs: OutputDirs) -> None:
    """Remove the journal folder's files through its descriptor, then the folder (not a link put in its place)."""
    folder = dirs.fd(JOURNAL_DIR)
    for name in os.listdir(folder):
        with suppress(OSError):
            os.unlink(name, dir_fd=folder)
    with suppress(OSError):  # ENOTDIR: the name is a link now, left as it is
        os.rmdir(JOURNAL_DIR, dir_fd=dirs.fd())


def write_bmap(root: Path) -> tuple[Path | None, str]:
    """Map the shards with prep.mapping when it is available and the filesystem supports it; else say why."""
    try:
        from prep.mapping import build_bmap
    except ImportError as exc:
        return None, f"block-map code unavailable ({exc})"
    try:
        build_bmap(root, root / BMAP, include=[f"{SHARD_DIR}/*"], require_mountpoint=False)
    except PrepError as exc:
        return None, str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return root / BMAP, ""
