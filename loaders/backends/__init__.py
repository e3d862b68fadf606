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
from typing import Any

from loaders.backends.base import Backend, ReadRequest, aligned_empty
from loaders.errors import BackendError, PrepError

# name -> "module:Class"; modules import their heavy dependencies only when the class is built
_REGISTRY: dict[str, str] = {
    "posix": "loaders.backends.posix:PosixBackend",
    "blockdev": "loaders.backends.blockdev:BlockdevBackend",
    "direct": "loaders.backends.direct:DirectBackend",
    "kvikio": "loaders.backends.kvikio:KvikioBackend",
    "xnvme": "loaders.backends.xnvme:XnvmeBackend",
}

# Order in which "auto" tries backends for each kind of destination (fastest first).
_AUTO_ORDER = {
    "cpu": ["direct", "posix"],
    "cuda": ["kvikio", "posix"],
}


def register(name: str, target: str) -> None:
    """Register a backend class by "module:Class" path (third-party backends may call this)."""
    _REGISTRY[name] = target


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
    """Build a backend. `auto` picks the fastest that works here for `device` ("cpu" or "cuda:N")."""
    if name != "auto":
        cls = backend_class(name)
        # GPU backends fill device memory; host backends ignore `device` (the dataset copies to the GPU).
        return cls(device=device, **options) if cls.gpu else cls(**options)  # type: ignore[call-arg]
    errors = []
    for candidate in _AUTO_ORDER["cuda" if device.startswith("cuda") else "cpu"]:
        if candidate not in _REGISTRY:
            continue
        try:
            return get_backend(candidate, device=device, **options)
        except (PrepError, OSError, TypeError) as exc:
            errors.append(f"{candidate}: {exc}")
    raise BackendError("no backend works here: " + "; ".join(errors))


__all__ = [
    "Backend",
    "ReadRequest",
    "aligned_empty",
    "backend_class",
    "backend_names",
    "get_backend",
    "register",
]
