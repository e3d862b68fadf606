"""The one error hierarchy of blockprep.

`PrepError` is the base for every error the library raises on purpose. It lives here, in the light
`loaders` package, because `loaders` may never import `prep`; `prep.errors` re-exports it. The CLI turns
any `PrepError` into a one-line message and exit code 1.
"""

from __future__ import annotations


class PrepError(Exception):
    """Base of all blockprep errors: the message is one line naming the file and the fix."""


class MissingDependencyError(PrepError):
    """An optional package is not installed; the message says which extra to install."""


class FormatError(PrepError):
    """A prepared cache or block map is malformed, from the future, or incomplete."""


class IncompleteCacheError(FormatError):
    """The cache has no manifest: it was never committed (interrupted run). Re-run `prep cache`."""


class SchemaVersionError(FormatError):
    """The file was written by a newer blockprep (unknown major schema version)."""


class ChecksumError(FormatError):
    """Bytes read do not match the checksum recorded when they were written."""


class StaleError(PrepError):
    """A block map or cache no longer matches what it describes (file changed, pipeline changed)."""


class BackendError(PrepError):
    """A backend cannot be built or cannot read (unknown name, unusable device, short read)."""


class UnsupportedFilesystemError(PrepError):
    """The filesystem or device cannot be mapped (no FIEMAP, btrfs, md/dm)."""


class UnsupportedChainError(PrepError, ValueError):
    """PreparedLoader cannot give MONAI's result for this chain; the message names the transform and what to do."""
