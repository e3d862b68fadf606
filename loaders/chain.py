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


def _qualname(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


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
    name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(type(fn)))}"
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return {"function": name}
    return {"function": name, "source_sha256": hashlib.sha256(source.encode()).hexdigest()}


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
