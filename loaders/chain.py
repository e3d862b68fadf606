"""The transform chain's head/tail split and the head's fingerprint: the ONE definition.

`prep cache` stores the output of the deterministic head (every transform before the first
`monai.transforms.Randomizable`); the loaders apply the random tail at training time and check the
fingerprint recorded in the manifest. Both sides call these functions, so they can never disagree.

Light at import: MONAI, torch and numpy are imported inside the functions.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Iterable, Mapping
from typing import Any

# Attribute names that hold random state or per-call scratch, never configuration.
_SKIP_ATTRS = frozenset({"R", "_do_transform", "_rand_state", "rand_state", "_seed"})
_MAX_DEPTH = 6


def _flat_transforms(transform: Any) -> list[Any]:
    """The transforms of a Compose (nested Composes flattened) or a list, in order."""
    from monai.transforms import Compose

    if isinstance(transform, Compose):
        return list(transform.flatten().transforms)
    if isinstance(transform, (list, tuple)):
        out: list[Any] = []
        for t in transform:
            out.extend(_flat_transforms(t) if isinstance(t, (Compose, list, tuple)) else [t])
        return out
    return [transform]


def split(transform: Any) -> tuple[list[Any], list[Any]]:
    """Split a Compose (or list) into (head, tail): head = the transforms before the first Randomizable."""
    from monai.transforms import Randomizable

    transforms = _flat_transforms(transform)
    for i, t in enumerate(transforms):
        if isinstance(t, Randomizable):
            return transforms[:i], transforms[i:]
    return transforms, []


# Code from these packages is named by module path; anything else (a class or function in the user's
# PIPELINE.py) by its name and source hash, because prep runs that file under a generated module name while
# training code imports it under its own.
_LIBRARIES = frozenset({"monai", "torch", "numpy", "scipy", "nibabel", "builtins", "loaders", "prep"})


def _qualname(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    module = str(getattr(cls, "__module__", ""))
    if module.split(".")[0] in _LIBRARIES:
        return f"{module}.{cls.__qualname__}"
    return f"{cls.__qualname__}@{_source_sha256(cls)}"


def _source_sha256(obj: Any) -> str:
    """Hash of the source of a function, or of a class's methods (a class from a file run by runpy has no
    module in sys.modules, so inspect cannot find the class itself, but finds its functions)."""
    if isinstance(obj, type):
        parts = [_source_text(v) for _, v in sorted(vars(obj).items()) if inspect.isfunction(v)]
        parts += [b.__qualname__ for b in obj.__mro__[1:]]
        text = "\n".join(parts)
    else:
        text = _source_text(obj)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _source_text(fn: Any) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return f"<no source: {getattr(fn, '__qualname__', type(fn).__name__)}>"


def _config(value: Any, depth: int = 0) -> Any:
    """A deterministic JSON-able rendering of a configuration value (no memory addresses, no RNG state)."""
    import numpy as np

    if depth > _MAX_DEPTH:
        return f"<{_qualname(value)}>"
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)  # NaN/inf stay comparable, and repr round-trips exactly
    if isinstance(value, np.random.RandomState) or type(value).__name__ == "Generator":
        return "<rng>"
    if isinstance(value, type):
        return _qualname(value) if value.__module__ != "builtins" else value.__name__
    if isinstance(value, np.dtype):
        return value.str
    if isinstance(value, np.generic):
        return _config(value.item(), depth + 1)
    if isinstance(value, np.ndarray) or hasattr(value, "detach"):
        arr = np.asarray(value.detach().cpu() if hasattr(value, "detach") else value)
        return {"array": str(arr.dtype), "shape": list(arr.shape), "sha256": hashlib.sha256(arr.tobytes()).hexdigest()}
    if isinstance(value, Mapping):
        return {str(k): _config(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_config(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_config(v, depth + 1) for v in value), key=repr)
    if inspect.isfunction(value) or inspect.ismethod(value) or inspect.isbuiltin(value):
        return _callable_config(value)
    if hasattr(value, "__dict__"):
        attrs = {k: v for k, v in vars(value).items() if k not in _SKIP_ATTRS}
        return {"class": _qualname(value), "config": _config(attrs, depth + 1)}
    return f"<{_qualname(value)}>"


def _callable_config(fn: Callable[..., Any]) -> dict[str, Any]:
    """A function by name and, where available, a hash of its source (so an edited lambda changes the hash)."""
    module = str(getattr(fn, "__module__", ""))
    name = str(getattr(fn, "__qualname__", repr(type(fn))))
    if module.split(".")[0] in _LIBRARIES:
        return {"function": f"{module}.{name}"}
    return {"function": name, "source_sha256": _source_sha256(fn)}


def versions() -> dict[str, str]:
    """Versions of the libraries whose behaviour shapes the head's output."""
    import monai
    import numpy
    import torch

    from loaders import __version__

    return {
        "monai": monai.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "blockprep": __version__,
    }


def fingerprint(head: Iterable[Any]) -> str:
    """Stable sha256 of each transform's class and configuration plus the library versions."""
    doc = {
        "transforms": [{"class": _qualname(t), "config": _config(_attrs(t))} for t in head],
        "versions": versions(),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _attrs(t: Any) -> Any:
    if inspect.isfunction(t) or inspect.ismethod(t):
        return _callable_config(t)
    if hasattr(t, "__dict__"):
        return {k: v for k, v in vars(t).items() if k not in _SKIP_ATTRS}
    return None


def describe(transforms: Iterable[Any]) -> list[str]:
    """One short line per transform, e.g. "Spacingd(keys=('image', 'label'))", for manifests and messages."""
    lines = []
    for t in transforms:
        name = getattr(t, "__qualname__", None) if inspect.isfunction(t) else type(t).__name__
        keys = getattr(t, "keys", None)
        lines.append(f"{name}(keys={tuple(keys)!r})" if isinstance(keys, (list, tuple)) else f"{name}()")
    return lines
