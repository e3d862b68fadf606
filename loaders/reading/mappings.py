"""Private mappings of shard bytes (`PosixBackend.mapped`): made here, tracked while mapped, and copied out of by
`own_storage` as an item leaves a dataset (a mapping of a shard its owner truncates later would kill the process
with SIGBUS at the first touch of a page past the new end). Its own module: the datasets need `own_storage`
without knowing a concrete backend."""

from __future__ import annotations

import ctypes
import mmap
import weakref
from collections.abc import Iterable
from typing import Any

import numpy as np

from loaders.reading.files import RA_DEFAULT, ask_limit

__all__ = ["mapped_at", "own_storage", "private_map", "will_need"]

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FAILED = ctypes.c_void_p(-1).value
_LIVE: dict[int, int] = {}  # address -> length of every mapping `private_map` made that is still mapped
_ASK: dict[int, int] = {}  # address -> the most one madvise(WILLNEED) reads of that mapping's file (`ask_limit`)


def _unmap(addr: int, length: int) -> None:
    _LIVE.pop(addr, None)
    _ASK.pop(addr, None)
    _libc.munmap(addr, length)


def private_map(fd: int, offset: int, length: int) -> np.ndarray | None:
    """`length` bytes of `fd` from `offset` (page-aligned) as a uint8 array over a MAP_PRIVATE mapping, unmapped
    when the array's buffer is collected; None when mmap fails (too many mappings: the caller reads instead).
    Python's `mmap.mmap` would keep a duplicate descriptor open per mapping: items held in memory would use up
    the process's descriptors."""
    addr = _libc.mmap(None, length, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, offset)
    if addr is None or addr == _MAP_FAILED:
        return None
    buffer = (ctypes.c_ubyte * length).from_address(addr)
    _LIVE[addr] = length
    _ASK[addr] = ask_limit(fd)
    weakref.finalize(buffer, _unmap, addr, length)
    return np.frombuffer(buffer, dtype=np.uint8)  # type: ignore[call-overload]  # a ctypes array is a buffer


def mapped_at(address: int) -> bool:
    """Whether `address` lies in a mapping `private_map` made that is still mapped."""
    return any(a <= address < a + n for a, n in list(_LIVE.items()))


def will_need(base: int, spans: Iterable[tuple[int, int]]) -> int:
    """Start reading the pages of each (byte offset, nbytes) span past address `base` of a mapping, all at once
    (madvise WILLNEED: the kernel queues the reads and returns; a later touch of a page waits only for its own
    read, and reads nothing around it). Spans sharing a page are asked for once; a run is asked for in pieces no
    longer than one call reads (`loaders.reading.files.ask_limit`: the kernel drops the rest of a longer range).
    Returns the calls made."""
    page = mmap.PAGESIZE
    runs: list[list[int]] = []
    for off, n in sorted(spans):
        if n <= 0:
            continue
        lo, hi = (base + off) // page * page, -(-(base + off + n) // page) * page
        if runs and lo <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], hi)
        else:
            runs.append([lo, hi])
    step = _ask_step(base)
    calls = 0
    for lo, hi in runs:
        for at in range(lo, hi, step):  # advice only: a failure leaves the touch to read the page
            _libc.madvise(at, min(step, hi - at), mmap.MADV_WILLNEED)
            calls += 1
    return calls


def _ask_step(address: int) -> int:
    """The most one madvise(WILLNEED) reads in the mapping holding `address` (whole pages; 128 KiB where the
    mapping is not one of `private_map`'s)."""
    for a, n in list(_LIVE.items()):
        if a <= address < a + n:
            return max(_ASK.get(a, RA_DEFAULT) // mmap.PAGESIZE, 1) * mmap.PAGESIZE
    return RA_DEFAULT


def own_storage(obj: Any) -> Any:
    """`obj` (an item: tensors in dicts, lists and tuples) with every tensor that is a view of a mapping of
    `PosixBackend.mapped` replaced by a copy. An item leaves the dataset so: a mapping of a shard that its owner
    truncates later would kill the process with SIGBUS on the first touch of a page past the new end, wherever
    the item is then; copied, it is the reader's own memory. A tail that crops made new tensors already
    (nothing is copied then)."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            obj[k] = own_storage(v)
        return obj
    if isinstance(obj, list):
        obj[:] = [own_storage(v) for v in obj]
        return obj
    if isinstance(obj, tuple) and type(obj) is tuple:
        return tuple(own_storage(v) for v in obj)
    storage = getattr(obj, "untyped_storage", None)
    if _LIVE and storage is not None and mapped_at(storage().data_ptr()):
        return obj.clone()
    return obj
