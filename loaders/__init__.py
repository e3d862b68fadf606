"""blockprep loaders: read prepared caches and block-mapped files fast, into CPU or GPU memory.

Light at import time: numpy and the standard library only. torch, kvikio, DALI, xNVMe and MONAI are
imported by the functions that use them.
"""

from __future__ import annotations

import importlib
from typing import Any

from loaders._version import __version__ as __version__
from loaders.backends import ReadRequest, backend_names, get_backend
from loaders.cache.format import PreparedCache
from loaders.errors import (
    BackendError,
    ChecksumError,
    FormatError,
    IncompleteCacheError,
    MissingDependencyError,
    PrepError,
    SchemaVersionError,
    StaleError,
    UnsafeFileError,
)

# Public names whose modules import torch (or MONAI): resolved on first access, so `import loaders` stays light.
_LAZY = {
    "BmapSource": "loaders.faces.dali",
    "CacheSource": "loaders.faces.dali",
    "FileSource": "loaders.faces.dali",
    "PreparedBatches": "loaders.faces.torch_data",
    "collate": "loaders.faces.batches",
    "pad_collate": "loaders.faces.batches",
    "PreparedDataset": "loaders.faces.torch_data",
    "PreparedLoader": "loaders.fast.loader",
    "PreparedPersistentDataset": "loaders.faces.monai_data",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'loaders' has no attribute {name!r}")


__all__ = [
    "BackendError",
    "BmapSource",
    "CacheSource",
    "ChecksumError",
    "FileSource",
    "FormatError",
    "IncompleteCacheError",
    "MissingDependencyError",
    "PrepError",
    "PreparedBatches",
    "PreparedCache",
    "PreparedDataset",
    "PreparedLoader",
    "PreparedPersistentDataset",
    "ReadRequest",
    "SchemaVersionError",
    "StaleError",
    "UnsafeFileError",
    "backend_names",
    "collate",
    "get_backend",
    "pad_collate",
]
