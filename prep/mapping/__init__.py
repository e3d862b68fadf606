"""Block maps made offline: walk and map a tree (`walk`), the flat seed form (`seed`), verify a map against
the raw device (`verify`). The document format itself is defined once, in `loaders.blockmap.bmap`.
(`prep.mapping.walk` is the module; its `walk` function lists a tree.)"""

from __future__ import annotations

from prep.mapping.seed import seed_document, seed_entry, seed_from_bmap, skipped_path, write_seed
from prep.mapping.verify import Mismatch, verify_bmap
from prep.mapping.walk import (
    FORMATS,
    PROCESS_MIN_FILES,
    BmapSummary,
    build_bmap,
    classify,
    files_json,
    header,
    map_tree,
    record_json,
    resolve_device,
)

__all__ = [
    "FORMATS",
    "PROCESS_MIN_FILES",
    "BmapSummary",
    "Mismatch",
    "build_bmap",
    "classify",
    "files_json",
    "header",
    "map_tree",
    "record_json",
    "resolve_device",
    "seed_document",
    "seed_entry",
    "seed_from_bmap",
    "skipped_path",
    "verify_bmap",
    "write_seed",
]
