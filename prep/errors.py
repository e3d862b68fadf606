"""Errors of the offline stages. The base `PrepError` is shared with `loaders` (defined there)."""

from __future__ import annotations

from loaders.errors import (
    BackendError,
    ChecksumError,
    FormatError,
    MissingDependencyError,
    PrepError,
    StaleError,
    UnsafeFileError,
    UnsupportedFilesystemError,
)


class UsageError(PrepError):
    """Bad arguments: a missing parent directory, a count of 0, an unwritable path."""


class UnsafeOutputError(UsageError):
    """The output folder holds a link (or a FIFO, device, hard link) `prep` did not make where it writes."""


class LockedError(PrepError):
    """Another `prep` run holds the output's lock."""


__all__ = [
    "BackendError",
    "ChecksumError",
    "FormatError",
    "LockedError",
    "MissingDependencyError",
    "PrepError",
    "StaleError",
    "UnsafeFileError",
    "UnsafeOutputError",
    "UnsupportedFilesystemError",
    "UsageError",
]
