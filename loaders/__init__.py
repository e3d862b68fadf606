"""blockprep loaders: read prepared caches and block-mapped files fast, into CPU or GPU memory.

Light at import time: numpy and the standard library only. torch, kvikio, DALI, xNVMe and MONAI are
imported by the functions that use them.
"""

from __future__ import annotations

from loaders.backends import ReadRequest, backend_names, get_backend
from loaders.errors import (
    BackendError,
    ChecksumError,
    FormatError,
    IncompleteCacheError,
    MissingDependencyError,
    PrepError,
    SchemaVersionError,
    StaleError,
)
from loaders.format import PreparedCache

__version__ = "0.1.0"

__all__ = [
    "BackendError",
    "ChecksumError",
    "FormatError",
    "IncompleteCacheError",
    "MissingDependencyError",
    "PrepError",
    "PreparedCache",
    "ReadRequest",
    "SchemaVersionError",
    "StaleError",
    "backend_names",
    "get_backend",
]
