"""Backends: one module per way of moving bytes, one interface, a registry.

    >>> from loaders.backends import get_backend, ReadRequest
    >>> with get_backend("posix") as b:
    ...     (buf,) = b.read([ReadRequest("/etc/hostname", 0, 4)])

`get_backend(name, **options)` builds one; an unknown name lists the known ones; a missing optional
dependency raises MissingDependencyError with the install command when the backend is built.
Backends register themselves lazily by module path so that `import loaders` never imports torch or kvikio.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from loaders.backends.base import Backend, ReadRequest, aligned_empty
from loaders.errors import ArgumentTypeError, BackendError, PrepError

# name -> "module:Class"; modules import their heavy dependencies only when the class is built
_REGISTRY: dict[str, str] = {
    "posix": "loaders.backends.posix:PosixBackend",
    "blockdev": "loaders.backends.blockdev:BlockdevBackend",
    "direct": "loaders.backends.direct:DirectBackend",
    "kvikio": "loaders.backends.kvikio:KvikioBackend",
    "xnvme": "loaders.backends.xnvme:XnvmeBackend",
    "xnvme-bmap": "loaders.backends.xnvme:XnvmeBmapBackend",
}
# Backends that read the files of a block map as device ranges (they take `bmap=`, `device_path=`).
BLOCK_RANGE_BACKENDS = ("blockdev", "xnvme-bmap")

# Order in which "auto" tries backends for each kind of destination (fastest first).
# GPU rule (measured without GDS: docs/benchmarks.md, Loaders): kvikio where GPUDirect Storage is
# active (storage -> GPU memory). In kvikio's compat mode, kvikio is fastest for data in the page cache
# (its small pinned bounce buffers stay in the CPU cache) but slower than O_DIRECT for cold data, so auto
# takes compat-mode kvikio only with `stage_cold` on (the default: cold requests go through the `direct`
# backend into pinned memory). Without kvikio: `direct` staged through pinned slots by the dataset.
_AUTO_ORDER = {
    "cpu": ["direct", "posix"],
    "cuda": ["kvikio", "direct", "posix"],
}
# Backends "auto" takes only when their check passes (else closed and the next one is tried).
_AUTO_ACCEPT: dict[str, Callable[[Backend], bool]] = {
    "kvikio": lambda b: getattr(b, "mode", "") == "gds" or bool(getattr(b, "stage_cold", False)),
}


def register(name: str, target: str) -> None:
    """Register a backend class by "module:Class" path (third-party backends may call this)."""
    _REGISTRY[name] = target


def check_backend(value: Any) -> None:
    """A backend name or a Backend object (the readers' `backend=` argument)."""
    if not isinstance(value, (str, Backend)):
        raise ArgumentTypeError(f"backend={value!r} is not a backend name (e.g. 'auto', 'posix') or a Backend")


def backend_names() -> list[str]:
    """Names `get_backend` accepts, besides "auto"."""
    return sorted(_REGISTRY)


def backend_class(name: str) -> type[Backend]:
    """Resolve a registered backend name to its class (imports its module)."""
    if name not in _REGISTRY:
        known = ", ".join(["auto", *backend_names()])
        raise BackendError(f"unknown backend '{name}'; known backends: {known}")
    module, _, cls = _REGISTRY[name].partition(":")
    return getattr(importlib.import_module(module), cls)  # type: ignore[no-any-return]


def get_backend(name: str = "auto", device: str = "cpu", **options: Any) -> Backend:
    """Build a backend. `auto` picks the fastest that works here for `device` ("cpu" or "cuda:N"): on a GPU,
    kvikio (GDS, or compat mode with cold reads staged through O_DIRECT), else `direct` through pinned memory."""
    if name != "auto":
        cls = backend_class(name)
        # GPU backends fill device memory; host backends ignore `device` (the dataset copies to the GPU).
        return cls(device=device, **options) if cls.gpu else cls(**options)  # type: ignore[call-arg]
    errors = []
    for candidate in _AUTO_ORDER["cuda" if device.startswith("cuda") else "cpu"]:
        if candidate not in _REGISTRY:
            continue
        try:
            backend = get_backend(candidate, device=device, **options)
        except (PrepError, OSError, TypeError) as exc:
            errors.append(f"{candidate}: {exc}")
            continue
        accept = _AUTO_ACCEPT.get(candidate)
        if accept is None or accept(backend):
            return backend
        backend.close()
        errors.append(f"{candidate}: skipped (no GPUDirect Storage and cold reads not staged)")
    raise BackendError("no backend works here: " + "; ".join(errors))


__all__ = [
    "BLOCK_RANGE_BACKENDS",
    "Backend",
    "ReadRequest",
    "aligned_empty",
    "backend_class",
    "backend_names",
    "check_backend",
    "get_backend",
    "register",
]
