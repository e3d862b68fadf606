"""The flat seed form of a block map: `{"train/a/img0.jpg": {"startblock": S, "endblock": E}}`.

Whole-disk LBAs, E inclusive, as the research loaders read them; only files that are one contiguous,
raw-readable run are written, the others are listed with their reason in `<output>.skipped.json`
(never silently truncated to their first extent).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from loaders.blockmap.bmap import BlockMap
from loaders.blockmap.fiemap import Extent, merge_adjacent
from loaders.cache.writing import atomic_write_bytes
from prep.errors import UsageError


def seed_entry(rec: dict[str, Any], partition_start: int, block: int) -> tuple[dict[str, int] | None, str | None]:
    """The flat seed entry {"startblock": S, "endblock": E} (whole-disk LBAs, E inclusive) of a mapped file,
    or (None, reason) when the file is not one contiguous raw-readable run."""
    size = rec["size"]
    if not rec["raw_readable"]:
        return None, rec["reason"]
    if size == 0:
        return None, "empty"
    live = [Extent(*e) for e in rec["extents"] if e[0] < size]
    if not live:
        return None, "hole"  # all sparse: nothing on the device to point at
    runs = merge_adjacent(live)
    if runs[0].logical != 0 or runs[0].length < size:
        return None, "hole" if len(runs) == 1 or runs[0].logical != 0 else "fragmented"
    start = partition_start + runs[0].physical
    if start % block:
        return None, "not_aligned"
    return {"startblock": start // block, "endblock": -(-(start + size) // block) - 1}, None


def seed_document(doc: dict[str, Any]) -> tuple[dict[str, dict[str, int]], dict[str, str]]:
    """Seed entries and skipped files (key -> reason) of a full bmap document."""
    seed: dict[str, dict[str, int]] = {}
    skipped: dict[str, str] = {}
    for key, rec in doc["files"].items():
        entry, why = seed_entry(rec, int(doc["partition_start"]), int(doc["logical_block_size"]))
        if entry is None:
            skipped[key] = why or "?"
        else:
            seed[key] = entry
    return seed, skipped


def skipped_path(output: Path) -> Path:
    """The side file next to a seed map listing the files left out, with reasons."""
    return output.with_name(output.name.removesuffix(".json") + ".skipped.json")


def write_seed(doc: dict[str, Any], output: Path) -> tuple[int, dict[str, str]]:
    """Write the seed form of `doc` to `output` and its skipped list beside it (both atomic)."""
    seed, skipped = seed_document(doc)
    atomic_write_bytes(skipped_path(output), json.dumps(skipped, indent=1, sort_keys=True).encode() + b"\n")
    atomic_write_bytes(output, json.dumps(seed, separators=(",", ":")).encode() + b"\n")
    return len(seed), skipped


def seed_from_bmap(bmap_path: Path, output: Path) -> tuple[int, dict[str, str]]:
    """Convert an existing bmap.json to the seed form without walking again: (files written, skipped)."""
    bmap = BlockMap.load(bmap_path)
    if bmap.flat:
        raise UsageError(f"{bmap_path}: already a flat startblock/endblock map; convert the full map of `prep bmap`")
    return write_seed(bmap.doc, output)
