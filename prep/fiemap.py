"""The FIEMAP ioctl lives in `loaders.fiemap` (raw readers check current extents with it); re-exported here."""

from __future__ import annotations

from loaders.fiemap import (
    DEFAULT_BATCH,
    EXTENT_FLAGS,
    FIEMAP_EXTENT_LAST,
    FIEMAP_FLAG_CACHE,
    FIEMAP_FLAG_SYNC,
    FIEMAP_FLAG_XATTR,
    FIEMAP_MAX_OFFSET,
    FS_IOC_FIEMAP,
    SAFE_FLAGS,
    UNSAFE_FLAGS,
    Extent,
    FiemapReader,
    fiemap,
    fiemap_fd,
    flag_names,
    merge_adjacent,
    unsafe_reasons,
)

__all__ = [
    "DEFAULT_BATCH",
    "EXTENT_FLAGS",
    "FIEMAP_EXTENT_LAST",
    "FIEMAP_FLAG_CACHE",
    "FIEMAP_FLAG_SYNC",
    "FIEMAP_FLAG_XATTR",
    "FIEMAP_MAX_OFFSET",
    "FS_IOC_FIEMAP",
    "SAFE_FLAGS",
    "UNSAFE_FLAGS",
    "Extent",
    "FiemapReader",
    "fiemap",
    "fiemap_fd",
    "flag_names",
    "merge_adjacent",
    "unsafe_reasons",
]
