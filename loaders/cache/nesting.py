"""Nested outputs as path keys: {"image": t, "crops": [a, b]} <-> {"image": t, "crops/0": a, "crops/1": b}.

The cache stores one tensor per path key (loaders.cache.format); the loaders nest them again where a user's transform
reads the structure the head made (ClassesToIndicesd's index list). `to_jsonable` turns metadata into plain JSON;
`map_leaves` rebuilds a nested value with its leaves mapped.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from loaders.errors import FormatError


def map_leaves(value: Any, fn: Callable[[Any], Any]) -> Any:
    """`value` rebuilt with every leaf (whatever is not a dict, list or tuple) replaced by `fn(leaf)`."""
    if isinstance(value, dict):
        return {k: map_leaves(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_leaves(v, fn) for v in value)
    return fn(value)


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """Flatten nested dicts/lists/tuples of leaves into {"a/0/b": leaf}. Leaves are anything else."""
    if isinstance(obj, Mapping):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            if "/" in str(k):
                raise FormatError(f"key {k!r} contains '/', which the cache uses as its path separator")
            out.update(flatten(v, f"{prefix}{k}/"))
        return out
    if isinstance(obj, (list, tuple)):
        out = {}
        for i, v in enumerate(obj):
            out.update(flatten(v, f"{prefix}{i}/"))
        return out
    return {prefix[:-1]: obj}


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `flatten`: path components that are all digits under one parent become lists."""
    root: dict[str, Any] = {}
    for path, leaf in flat.items():
        node = root
        parts = path.split("/")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = leaf
    return _listify(root)


def nested(item: Mapping[Any, Any]) -> tuple[dict[Any, Any], list[str]]:
    """(an item whose "key/0"-style entries are nested again as the head made them, the keys so nested): what
    a user's transform reads (ClassesToIndicesd's index list) reaches it as MONAI gives it."""
    parts = {k: v for k, v in item.items() if isinstance(k, str) and "/" in k}
    if not parts:
        return dict(item), []
    plain = {k: v for k, v in item.items() if k not in parts}
    return {**plain, **unflatten(parts)}, sorted({k.split("/", 1)[0] for k in parts})


def flat_again(out: dict[Any, Any], keys: Sequence[str]) -> dict[Any, Any]:
    """`out` with the keys `nested` nested made flat again (those the transform left there)."""
    for key in keys:
        if key in out:
            out.update(flatten({key: out.pop(key)}))
    return out


def _listify(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    items = {k: _listify(v) for k, v in node.items()}
    if items and all(k.isdigit() for k in items) and sorted(int(k) for k in items) == list(range(len(items))):
        return [items[str(i)] for i in range(len(items))]
    return items


def to_jsonable(value: Any) -> Any:
    """Metadata to plain JSON (numpy/torch arrays to nested lists, numpy scalars to Python)."""
    if hasattr(value, "detach"):  # torch tensor, without importing torch
        value = value.detach().cpu()
        value = (value.float() if str(value.dtype) == "torch.bfloat16" else value).numpy()  # numpy has no bf16
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)
