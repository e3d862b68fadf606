"""xNVMe reads through libxnvme's Python ctypes bindings (`pip install 'blockprep[xnvme]'` plus libxnvme).

Files go through xNVMe's file API (`xnvme_file_open` + `xnvme_file_pread`); block ranges of a device
(for example the bmap ranges of a prepared cache) go through `xnvme_nvm_read` on the opened device URI.
Commands are synchronous; depth comes from the thread pool (ctypes releases the GIL during each call),
which keeps this backend simple and works with every xNVMe sync interface (psync, block, nvme ioctl).
The bindings find libxnvme through the linker path, pkg-config, or `XNVME_LIBRARY_PATH`.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from loaders.backends.base import Backend, ReadRequest, aligned_empty, short_read
from loaders.cache.layout import checked_path
from loaders.deps import require
from loaders.errors import BackendError, MissingDependencyError

_INSTALL = "install libxnvme (distro package, conda-forge or source) or set XNVME_LIBRARY_PATH to libxnvme.so"


def load_capi() -> ModuleType:
    """The xNVMe ctypes API module, or MissingDependencyError when the bindings or libxnvme are missing."""
    require("xnvme", "the xnvme backend")
    try:
        from xnvme.ctypes_bindings import api
    except (ImportError, OSError) as exc:
        raise MissingDependencyError(f"xnvme bindings cannot be imported ({exc}); {_INSTALL}") from exc
    if not api.is_loaded:
        raise MissingDependencyError(f"xnvme bindings are installed but libxnvme cannot be loaded; {_INSTALL}")
    return api


def _host_view(buf: Any, nbytes: int) -> np.ndarray:
    arr = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, dtype=np.uint8)
    if not arr.flags.c_contiguous or arr.nbytes < nbytes:
        raise BackendError(f"xnvme: buffers must be C-contiguous and hold at least {nbytes} bytes")
    return arr.reshape(-1).view(np.uint8)


def _strings(be: str | None, sync: str | None) -> dict[str, Any]:
    return {k: ctypes.create_string_buffer(v.encode()) for k, v in (("be", be), ("sync", sync)) if v}


class XnvmeBackend(Backend):
    """Reads files with xNVMe's file API and device block ranges with `read_device_ranges`.

    `device_uri` (e.g. "/dev/nvme0n1", "/dev/loop3", a PCIe address with the SPDK backend) is needed only
    for `read_device_ranges`; `be`/`sync` pick xNVMe's backend and sync interface (None: its default).
    Requests are split into `chunk`-byte commands so one large read keeps `threads` commands in flight.
    """

    name = "xnvme"

    def __init__(
        self,
        device_uri: str | None = None,
        threads: int = 16,
        chunk: int = 1 << 20,
        be: str | None = None,
        sync: str | None = None,
        direct: bool = False,
    ) -> None:
        self._capi = load_capi()
        super().__init__(threads)
        self.device_uri = device_uri
        self.chunk = chunk
        self.be, self.sync, self.direct = be, sync, direct
        # string buffers live as long as the backend: libxnvme keeps the option pointers in opened devices
        self._keep = _strings(be, sync)
        self._files: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._dev: Any = None

    def _opts(self) -> Any:
        opts = self._capi.xnvme_opts_default()
        opts.rdonly = 1
        opts.direct = int(self.direct)
        for key, value in self._keep.items():
            setattr(opts, key, ctypes.cast(value, ctypes.POINTER(ctypes.c_char)))
        return opts

    def _open(self, uri: str) -> Any:
        opts = self._opts()
        dev = self._capi.xnvme_dev_open(uri.encode(), ctypes.byref(opts))
        if not dev:
            why = "no such file or device" if not os.path.exists(uri) else "xnvme_dev_open failed"
            raise BackendError(f"{uri}: cannot open with xnvme ({why}); check the path, permissions and be/sync")
        return dev

    def _file(self, path: str) -> Any:
        with self._lock:
            dev = self._files.get(path)
            if dev is None:
                with checked_path(path) as name:  # a cache shard: the very file checked when its cache opened
                    dev = self._files[path] = self._open(name)
                while len(self._files) > 256:
                    self._capi.xnvme_dev_close(self._files.popitem(last=False)[1])
            return dev

    def _pread(self, dev: Any, req: ReadRequest, out: np.ndarray, start: int, n: int) -> int:
        """One synchronous file read of out[start:start+n] from req.offset+start; returns bytes read."""
        x = self._capi
        ctx = x.xnvme_cmd_ctx_from_dev(dev)
        ptr = ctypes.c_void_p(out.ctypes.data + start)
        err = x.xnvme_file_pread(ctypes.byref(ctx), ptr, n, req.offset + start)
        if err == 0 and int(ctx.cpl.result) == n:
            return n
        # psync reports a short read at end of file like an error: tell the two apart by the file size
        left = os.path.getsize(req.path) - (req.offset + start)
        if left < n:
            return max(0, left)
        why = os.strerror(-err) if err < 0 else f"{int(ctx.cpl.result)} of {n} bytes"
        raise BackendError(f"{req.path}: xnvme read failed at offset {req.offset + start} ({why})")

    def read_into(self, requests: Sequence[ReadRequest], buffers: Sequence[Any]) -> None:
        pieces = []
        for req, buf in zip(requests, buffers):
            out = _host_view(buf, req.nbytes)
            dev = self._file(req.path)
            pieces += [(dev, req, out, s, min(self.chunk, req.nbytes - s)) for s in range(0, req.nbytes, self.chunk)]
        if len(pieces) <= 1 or self.threads <= 1:
            got = [self._pread(*p) for p in pieces]
        else:
            got = [f.result() for f in [self.pool.submit(self._pread, *p) for p in pieces]]
        for (_, req, _, start, n), g in zip(pieces, got):
            if g < n:
                raise short_read(req, start + g)

    def _device(self) -> tuple[Any, int, int]:
        """(device handle, namespace id, LBA size) of `device_uri`, opened once."""
        if self.device_uri is None:
            raise BackendError("xnvme: read_device_ranges needs XnvmeBackend(device_uri='/dev/...')")
        with self._lock:
            if self._dev is None:
                self._dev = self._open(self.device_uri)
            x = self._capi
            geo = x.xnvme_dev_get_geo(self._dev).contents
            return self._dev, int(x.xnvme_dev_get_nsid(self._dev)), int(geo.lba_nbytes)

    def _nvm_read(self, dev: Any, nsid: int, lba: int, slba: int, nlb: int, out: np.ndarray, pos: int) -> None:
        x = self._capi
        ctx = x.xnvme_cmd_ctx_from_dev(dev)
        err = x.xnvme_nvm_read(ctypes.byref(ctx), nsid, slba, nlb - 1, ctypes.c_void_p(out.ctypes.data + pos), None)
        if err:
            msg = os.strerror(-err) if err < 0 else f"NVMe status {err:#x}"
            raise BackendError(f"{self.device_uri}: xnvme block read of LBA {slba}+{nlb} (x{lba} B) failed ({msg})")

    def read_device_ranges(self, ranges: Sequence[tuple[int, int]]) -> list[np.ndarray]:
        """Read (device byte offset, nbytes) ranges of `device_uri`; returns one uint8 array per range.

        Each range is read as the LBAs covering it (in commands of at most `chunk` bytes and 65536 LBAs)
        into an aligned buffer, and returned as a view of exactly the bytes asked for.
        """
        dev, nsid, lba = self._device()
        per_cmd = max(1, min(self.chunk // lba, 1 << 16))
        jobs, outs = [], []
        for off, n in ranges:
            first, last = off // lba, -(-(off + n) // lba)
            out = aligned_empty((last - first) * lba)
            outs.append(out[off - first * lba : off - first * lba + n])
            for s in range(first, last, per_cmd):
                jobs.append((dev, nsid, lba, s, min(per_cmd, last - s), out, (s - first) * lba))
        if len(jobs) <= 1 or self.threads <= 1:
            for j in jobs:
                self._nvm_read(*j)
        else:
            for f in [self.pool.submit(self._nvm_read, *j) for j in jobs]:
                f.result()
        return outs

    def close(self) -> None:
        super().close()
        with self._lock:
            for dev in self._files.values():
                self._capi.xnvme_dev_close(dev)
            self._files.clear()
            if self._dev is not None:
                self._capi.xnvme_dev_close(self._dev)
                self._dev = None

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.update(_capi=None, _files=OrderedDict(), _lock=None, _dev=None, _keep=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._capi = load_capi()
        self._lock = threading.Lock()
        self._keep = _strings(self.be, self.sync)


class XnvmeBmapBackend(Backend):
    """Files of a block map read as device block ranges with xNVMe (`xnvme_nvm_read` on the map's device, or
    the loop image standing in for it); holes read as zeros. The stale-file rule is blockdev's
    (`loaders.backends.mapped.MappedFiles`): files not raw-readable or changed since mapping are read through
    the filesystem with one warning each, or raise BackendError with `fallback=False`.

        get_backend("xnvme-bmap", bmap="bmap.json", device_path="/dev/nvme0n1")
    """

    name = "xnvme-bmap"

    def __init__(
        self,
        bmap: Any,
        device_path: str | os.PathLike[str] | None = None,
        threads: int = 16,
        fallback: bool = True,
        check_stale: bool = True,
        be: str | None = None,
        sync: str | None = None,
    ) -> None:
        from loaders.backends.mapped import MappedFiles
        from loaders.blockmap.bmap import BlockMap

        load_capi()  # a missing libxnvme is reported before anything else
        super().__init__(threads)
        self.bmap = bmap if isinstance(bmap, BlockMap) else BlockMap.load(bmap)
        self.guard = MappedFiles(self.bmap, self.bmap.source(device_path), fallback, check_stale)
        self.base = self.guard.source.base  # from the system, not from the map
        self.xnvme = XnvmeBackend(device_uri=self.guard.source.path, threads=threads, be=be, sync=sync)

    def read_into(self, requests: Sequence[ReadRequest], buffers: Sequence[Any]) -> None:
        from loaders.errors import FormatError

        ranges: list[tuple[int, int]] = []
        dests: list[np.ndarray] = []
        for req, buf in zip(requests, buffers):
            out = _host_view(buf, req.nbytes)[: req.nbytes]
            try:
                key = self.bmap.key_for(req.path)
            except FormatError as exc:
                raise BackendError(str(exc)) from None
            why = self.guard.reason(key)
            if why:
                self.guard.fs_read(key, why, req, out.data)
                continue
            try:
                segments = self.bmap.segments(key, req.offset, req.nbytes)
            except ValueError:
                raise short_read(req, max(0, self.bmap.entry(key).size - req.offset)) from None
            for seg in segments:
                at = seg.file_offset - req.offset
                if seg.device_offset is None:
                    out[at : at + seg.nbytes] = 0  # a hole reads as zeros
                else:
                    ranges.append((self.base + seg.device_offset, seg.nbytes))
                    dests.append(out[at : at + seg.nbytes])
        for dest, data in zip(dests, self.xnvme.read_device_ranges(ranges) if ranges else []):
            dest[:] = data

    def changed(self, keys: Iterable[str]) -> set[str]:
        """The keys among `keys` whose files were found changed since mapping (none until checked)."""
        return self.guard.changed(keys)

    def close(self) -> None:
        super().close()
        self.xnvme.close()
        self.guard.close()
