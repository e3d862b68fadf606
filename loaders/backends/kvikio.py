"""kvikio `CuFile.pread` straight into GPU memory: GPUDirect Storage where present, kvikio's POSIX
compat mode (its own thread pool reading through a pinned bounce buffer) otherwise.

Needs an NVIDIA GPU, kvikio and cupy or torch: `pip install 'blockprep[gpu]'`. kvikio's thread count,
task size and compat mode are process-wide settings; building a backend sets them for the process.
"""

from __future__ import annotations

import importlib
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import numpy as np

from loaders.backends.base import Backend, ReadRequest, short_read
from loaders.backends.direct import DirectBackend
from loaders.cache.layout import checked_path
from loaders.cache.spec import ALIGN, align_up
from loaders.deps import has, require
from loaders.errors import BackendError, MissingDependencyError

_INSTALL = "pip install 'blockprep[gpu]'"


def _device_index(device: str) -> int:
    kind, _, idx = device.partition(":")
    if kind != "cuda" or (idx and not idx.isdigit()):
        raise BackendError(f"kvikio: device '{device}' is not a CUDA device; use device='cuda:N'")
    return int(idx or 0)


def _configure(
    kvikio: ModuleType, threads: int, task_size: int, compat: bool | None, direct_io: bool | None = None
) -> None:
    """Set kvikio's process-wide settings through its current API (`defaults.set`, kvikio >= 25.02),
    or the older `*_reset` functions (which know no direct-I/O setting)."""
    d = importlib.import_module("kvikio.defaults")  # a submodule that `import kvikio` does not load
    if hasattr(d, "set") and hasattr(d, "get"):
        d.set({"num_threads": threads, "task_size": task_size})
        if compat is not None:
            d.set("compat_mode", kvikio.CompatMode.ON if compat else kvikio.CompatMode.OFF)
        if direct_io is not None:
            try:  # kvikio >= 25.10: compat-mode reads of aligned ranges use O_DIRECT
                d.set("auto_direct_io_read", direct_io)
            except (KeyError, ValueError, RuntimeError, TypeError) as exc:
                raise BackendError(f"kvikio: no direct-I/O read setting here ({exc}); drop direct_io") from exc
    elif direct_io is not None:
        raise BackendError("kvikio: this version has no direct-I/O read setting; upgrade kvikio or drop direct_io")
    else:
        d.num_threads_reset(threads)
        d.task_size_reset(task_size)
        if compat is not None:
            d.compat_mode_reset(compat)


def compat_mode_active(kvikio: ModuleType) -> bool:
    """True when kvikio reads through its POSIX compat mode (no GDS) in this process."""
    d = importlib.import_module("kvikio.defaults")
    if hasattr(d, "is_compat_mode_preferred"):
        return bool(d.is_compat_mode_preferred())
    return bool(d.compat_mode())


def _failure(req: ReadRequest, exc: Exception) -> BackendError:
    """kvikio raises (RuntimeError "...EOF") where a read passes the end of file: call that a short read."""
    size = os.path.getsize(req.path)
    if req.offset + req.nbytes > size:
        return short_read(req, max(0, size - req.offset))
    return BackendError(f"{req.path}: read failed at offset {req.offset} ({exc})")


def _pinned(nbytes: int) -> tuple[Any, np.ndarray]:
    """(owner, aligned uint8 view) of page-locked host memory: torch's pinned allocator, else cupy's."""
    if has("torch"):
        from loaders.backends.base import pinned_empty

        return pinned_empty(nbytes)
    import cupy

    mem = cupy.cuda.alloc_pinned_memory(nbytes + ALIGN)
    raw = np.frombuffer(mem, np.uint8, nbytes + ALIGN)
    start = (-raw.ctypes.data) % ALIGN
    return mem, raw[start : start + nbytes]


def _to_device(buf: Any, host: np.ndarray) -> None:
    """Copy `host` into the first bytes of device array `buf` (cupy array or torch CUDA tensor); returns
    when the copy is done, so the staging buffer may be reused."""
    n = host.nbytes
    if hasattr(buf, "set"):  # cupy
        buf[:n].set(host)
        return
    import torch

    buf[:n].copy_(torch.from_numpy(host))


class KvikioBackend(Backend):
    """`kvikio.CuFile(path).pread` into device buffers, every request of a batch in flight at once.

    Buffers are cupy arrays (or torch CUDA uint8 tensors with `array="torch"`, or when cupy is
    missing); `read_into` accepts any CUDA array with `__cuda_array_interface__`. `mode` says whether
    reads go through GDS ("gds") or kvikio's compat mode ("compat"). `direct_io=True` makes compat-mode
    reads use O_DIRECT (kvikio's `auto_direct_io_read`; None leaves the process-wide setting alone).

    In compat mode with `stage_cold=True` (default) only requests wholly in the page cache (asked through
    cachestat(2), no I/O) go through kvikio; the others are read by the `direct` backend (O_DIRECT, many in
    flight) into a pinned, aligned host buffer and copied to the device. Measured without GDS (docs/benchmarks.md),
    kvikio's compat mode is the fastest path for cached data (its small pinned bounce buffers stay in the
    CPU cache) and O_DIRECT the fastest for cold data (no page-cache copy, no readahead guesswork).
    """

    name = "kvikio"
    gpu = True

    def __init__(
        self,
        device: str = "cuda:0",
        threads: int = 16,
        task_size: int = 4 << 20,
        compat: bool | None = None,
        array: str = "auto",
        direct_io: bool | None = None,
        stage_cold: bool = True,
    ) -> None:
        super().__init__(threads)
        self.device = device
        self.index = _device_index(device)
        self.task_size = task_size
        self.compat = compat
        self._kvikio = require("kvikio", "the kvikio backend")
        self.array = self._pick_array(array)
        self._check_gpu()
        self.direct_io = direct_io
        _configure(self._kvikio, threads, task_size, compat, direct_io)
        self.mode = "compat" if compat_mode_active(self._kvikio) else "gds"
        self.stage_cold = stage_cold and self.mode == "compat"
        self._files: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()
        self._init_staging()

    def _init_staging(self) -> None:
        self._direct: DirectBackend | None = DirectBackend(self.threads) if self.stage_cold else None
        self._stage = threading.local()  # per calling thread: pinned staging buffer for cold requests

    def _pick_array(self, array: str) -> str:
        if array not in ("auto", "cupy", "torch"):
            raise BackendError(f"kvikio: array='{array}' is not one of auto, cupy, torch")
        if array in ("auto", "cupy"):
            try:
                require("cupy", "kvikio device buffers")
                return "cupy"
            except MissingDependencyError:
                if array == "cupy":
                    raise
        require("torch", "kvikio device buffers")
        return "torch"

    def _check_gpu(self) -> None:
        try:
            if self.array == "cupy":
                import cupy

                count = cupy.cuda.runtime.getDeviceCount()
            else:
                import torch

                count = torch.cuda.device_count()
        except Exception as exc:  # cupy raises its CUDARuntimeError when there is no driver
            raise BackendError(f"kvikio: no usable CUDA GPU ({exc}); use backend='posix' or {_INSTALL}") from exc
        if self.index >= count:
            raise BackendError(f"kvikio: {self.device} not present ({count} CUDA devices); use backend='posix'")

    def allocate(self, nbytes: int) -> Any:
        """A uint8 device buffer of `nbytes` on this backend's GPU."""
        if self.array == "cupy":
            import cupy

            with cupy.cuda.Device(self.index):
                return cupy.empty(max(nbytes, 1), dtype=cupy.uint8)
        import torch

        return torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)

    def _file(self, path: str) -> Any:
        with self._lock:
            f = self._files.get(path)
            if f is not None:
                self._files.move_to_end(path)
                return f
            try:
                with checked_path(path) as name:  # a cache shard: the very file checked when its cache opened
                    f = self._kvikio.CuFile(name, "r")
            except (OSError, RuntimeError) as exc:
                raise BackendError(f"{path}: cannot open ({exc}); check the path and permissions") from exc
            self._files[path] = f
            return f

    def _trim(self) -> None:
        # only between batches: a handle closed under an in-flight pread would fail that read
        with self._lock:
            while len(self._files) > 256:
                self._files.popitem(last=False)[1].close()

    def read_into(self, requests: Sequence[ReadRequest], buffers: Sequence[Any]) -> None:
        cold = self._cold(requests)
        futures: list[tuple[ReadRequest, Any]] = []
        errors: list[BackendError] = []
        try:
            for i, (req, buf) in enumerate(zip(requests, buffers)):
                if len(buf) < req.nbytes:
                    raise BackendError(
                        f"{req.path}: buffer of {len(buf)} bytes is smaller than the read ({req.nbytes})"
                    )
                if not req.nbytes or i in cold:
                    continue
                handle = self._file(req.path)
                try:  # reads under kvikio's GDS threshold run at once, and raise here rather than in get()
                    futures.append((req, handle.pread(buf[: req.nbytes], req.nbytes, req.offset, self.task_size)))
                except (OSError, RuntimeError) as exc:
                    errors.append(_failure(req, exc))
            if cold and not errors:  # while kvikio's threads copy the cached requests
                self._read_cold([requests[i] for i in cold], [buffers[i] for i in cold])
        except BackendError as exc:
            errors.append(exc)
        for req, fut in futures:  # wait for every read before raising: none may still write into the buffers
            err = self._wait(req, fut)
            if err is not None:
                errors.append(err)
        self._trim()
        if errors:
            raise errors[0]

    def _cold(self, requests: Sequence[ReadRequest]) -> set[int]:
        """Positions of requests not wholly in the page cache (empty unless staging cold reads)."""
        if self._direct is None:
            return set()
        return {i for i, r in enumerate(requests) if r.nbytes and not self._direct._warm(r)}

    def _read_cold(self, requests: list[ReadRequest], buffers: list[Any]) -> None:
        """O_DIRECT reads into this thread's pinned staging buffer, then one host-to-device copy each."""
        assert self._direct is not None
        places, pos = [], 0
        for r in requests:
            places.append(pos)
            pos += align_up(r.nbytes)
        stage = getattr(self._stage, "buf", None)
        if stage is None or stage[1].nbytes < pos:
            stage = self._stage.buf = _pinned(pos + pos // 8)
        host = stage[1]
        views = [host[p : p + r.nbytes] for p, r in zip(places, requests)]
        self._direct.read_into(requests, views)
        for view, buf in zip(views, buffers):
            _to_device(buf, view)

    @staticmethod
    def _wait(req: ReadRequest, fut: Any) -> BackendError | None:
        try:
            got = fut.get()
        except (OSError, RuntimeError) as exc:
            return _failure(req, exc)
        return short_read(req, got) if got < req.nbytes else None

    def close(self) -> None:
        super().close()
        if self._direct is not None:
            self._direct.close()
        with self._lock:
            for f in self._files.values():
                f.close()
            self._files.clear()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_kvikio"] = None
        state["_files"] = OrderedDict()
        state["_lock"] = None
        state["_stage"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._kvikio = require("kvikio", "the kvikio backend")
        self._lock = threading.Lock()
        self._init_staging()
