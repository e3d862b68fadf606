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


class UnsafeFileError(FormatError):
    """A file of a cache or block map is a link, a FIFO, a device, outside its root, over its size bound, or
    changed under the reader: refused before a byte is used (`loaders.opener`)."""


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


class ArgumentError(PrepError):
    """A bad argument to a reader, refused when the object is built: the message names it and what fits."""


class ArgumentTypeError(ArgumentError, TypeError):
    """An argument of the wrong type (a string where a flag or a number belongs, a float index)."""


class ArgumentValueError(ArgumentError, ValueError):
    """An argument of the right type out of range (batch_size=0, seed=2**70, device='tpu')."""


class ArgumentKeyError(ArgumentError, KeyError):
    """A key the cache does not hold; the message lists the ones it does."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ArgumentIndexError(ArgumentError, IndexError):
    """An item index outside the dataset."""


class ArgumentPathError(ArgumentError, FileNotFoundError):
    """A path argument naming no folder there (a DALI source's class-folder root)."""


class LoaderStateError(PrepError, ValueError):
    """A saved loader state that does not belong to this loader (another cache, transform or order)."""
