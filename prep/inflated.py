"""A .nii.gz decoded once: the bytes `prep cache`'s input check inflated (zlib checks the CRC and length there)
are what nibabel reads for the head, instead of inflating the file a second time.

Inside `served({path: bytes})`, nibabel's opener for `.gz` names (`nibabel.openers`, as MONAI's `LoadImage`
reaches it) hands out an in-memory file of those bytes for exactly those paths, read-only; every other path,
and every path outside the block, opens as before. The arrays and headers are the ones the file gives (the
same bytes, checked), at the cost of one copy of the decoded item held while the head runs; loading from the
bytes is a small fraction of loading from the file (docs/benchmarks.md, Preparation).
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

_SERVED: dict[str, list[Any]] = {}  # real path -> [decoded bytes, blocks using it]
_LOCK = threading.Lock()
_INSTALLED: list[Any] = []


def _key(path: Any) -> str | None:
    try:
        return os.path.realpath(os.fspath(path))
    except TypeError:
        return None


def _opener(original: Any) -> Any:
    def open_gz(fileish: Any, *args: Any, **kwargs: Any) -> Any:
        mode = kwargs.get("mode", args[0] if args else "rb")
        if _SERVED and mode in ("rb", "r") and (key := _key(fileish)) is not None:
            with _LOCK:
                slot = _SERVED.get(key)
            if slot is not None:
                return io.BytesIO(slot[0])
        return original(fileish, *args, **kwargs)

    return open_gz


def _install() -> None:
    """Put the serving opener in front of nibabel's .gz opener (once per process)."""
    if _INSTALLED:
        return
    from nibabel.openers import ImageOpener, Opener

    for cls in (Opener, ImageOpener):
        original, names = cls.compress_ext_map[".gz"]
        cls.compress_ext_map[".gz"] = (_opener(original), names)
    _INSTALLED.append(True)


@contextmanager
def served(decoded: Mapping[str, bytes]) -> Iterator[None]:
    """nibabel reads these paths' decoded bytes instead of the files while the block runs (any thread)."""
    if not decoded:
        yield
        return
    _install()
    keys = []
    with _LOCK:
        for path, data in decoded.items():
            key = _key(path)
            if key is None:
                continue
            slot = _SERVED.setdefault(key, [data, 0])
            slot[1] += 1
            keys.append(key)
    try:
        yield
    finally:
        with _LOCK:
            for key in keys:
                slot = _SERVED[key]
                slot[1] -= 1
                if slot[1] == 0:
                    del _SERVED[key]
