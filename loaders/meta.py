"""The per-item metadata format of a prepared cache, both directions: `prep cache` encodes a head's output
with `split_output`; readers decode it with `restore_meta` / `meta_template` + `from_template`.

One meta line per item (JSON)::

    {"source": datalist entry, "section": datalist section,
     "meta": {key: MetaTensor meta}, "applied_operations": {key: [...]}, "values": {key: non-tensor output}}

Each line key is named once, here. Everything heavy (torch, MONAI) is imported inside the functions.
"""

from __future__ import annotations

import copy
import enum
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from loaders.errors import FormatError
from loaders.format import dtype_code, flatten, to_jsonable

# meta line keys
SOURCE = "source"  # the datalist entry the item was prepared from
SECTION = "section"  # its datalist section ("training", ...)
META = "meta"  # {flat key: MetaTensor meta (JSON)}
OPS = "applied_operations"  # {flat key: MetaTensor applied_operations (JSON)}
VALUES = "values"  # {flat key: non-tensor output of the head (JSON)}

# MetaTensor meta keys that are not arrays although JSON stored them as lists
_LIST_META = (OPS, "crop_center")


# --- encode (prep cache) ---
def split_output(out: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Head output -> ({flat key: array}, meta line parts: per-key meta, applied operations, plain values)."""
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    ops: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for key, leaf in flatten(out).items():
        if hasattr(leaf, "detach"):  # torch.Tensor or MONAI MetaTensor
            if hasattr(leaf, "meta"):
                meta[key] = to_jsonable(dict(leaf.meta))
                jsonable_ops = _strict_jsonable(getattr(leaf, "applied_operations", []))
                if jsonable_ops is not None:
                    ops[key] = jsonable_ops
                leaf = leaf.as_tensor()
            arrays[key] = np.ascontiguousarray(leaf.detach().cpu().numpy())
        elif isinstance(leaf, (np.ndarray, np.generic)):
            arrays[key] = np.ascontiguousarray(leaf)
        else:
            values[key] = to_jsonable(leaf)
    for key, array in arrays.items():
        try:
            dtype_code(array.dtype)
        except FormatError as exc:
            raise FormatError(f"output '{key}': {exc}") from None
    parts: dict[str, Any] = {META: meta}
    if ops:
        parts[OPS] = ops
    if values:
        parts[VALUES] = values
    return arrays, parts


def meta_line(source: Any, section: str, parts: Mapping[str, Any]) -> dict[str, Any]:
    """The item's meta line from its datalist entry, section and `split_output` parts."""
    return {SOURCE: source, SECTION: section, **parts}


def _strict_jsonable(value: Any) -> Any:
    """`value` as plain JSON, or None when it holds objects JSON cannot carry faithfully."""
    try:
        doc = to_jsonable(value)
        _reject_strings_of_objects(value)
        json.dumps(doc)
    except (TypeError, ValueError):
        return None
    return doc


def _reject_strings_of_objects(value: Any) -> None:
    if isinstance(value, Mapping):
        for v in value.values():
            _reject_strings_of_objects(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _reject_strings_of_objects(v)
    elif not (
        value is None or isinstance(value, (str, int, float, bool, np.ndarray, np.generic)) or hasattr(value, "detach")
    ):
        raise TypeError(type(value).__name__)


# --- decode (loaders) ---
def item_metas(line: Mapping[str, Any] | None) -> dict[str, Any]:
    """{flat key: MetaTensor meta} of a meta line, each with its applied operations folded in."""
    line = line or {}
    metas = {k: dict(v or {}) for k, v in (line.get(META) or {}).items()}
    for key, ops in (line.get(OPS) or {}).items():
        if ops is not None:
            metas.setdefault(key, {})[OPS] = ops
    return metas


def key_meta(line: Mapping[str, Any] | None, key: str) -> dict[str, Any]:
    """The MetaTensor meta of flat key `key` (falling back to its top-level key), applied operations in."""
    line = line or {}
    metas = line.get(META) or {}
    meta = dict(metas.get(key, metas.get(key.split("/")[0])) or {})
    ops = (line.get(OPS) or {}).get(key)
    if ops is not None:
        meta[OPS] = ops
    return meta


def line_values(line: Mapping[str, Any] | None) -> dict[str, Any]:
    """The head's non-tensor outputs stored in a meta line."""
    return dict((line or {}).get(VALUES) or {})


def line_source(line: Mapping[str, Any] | None) -> Any:
    """The datalist entry a meta line was prepared from."""
    return (line or {}).get(SOURCE)


def line_meta(line: Mapping[str, Any] | None) -> dict[str, Any]:
    """{flat key: MetaTensor meta} as stored (applied operations apart)."""
    return dict((line or {}).get(META) or {})


def restore_meta(tensor: Any, meta: Mapping[str, Any] | None) -> Any:
    """Wrap a tensor as a MONAI MetaTensor with its stored meta, types as LoadImage made them: affine a
    float64 tensor, original_affine and other numeric lists numpy arrays, space a SpaceKeys."""
    import torch
    from monai.data import MetaTensor
    from monai.utils import SpaceKeys

    meta = dict(meta or {})
    ops = meta.pop(OPS, None)
    affine = meta.pop("affine", None)
    if affine is not None:
        affine = torch.as_tensor(np.asarray(affine, dtype=np.float64))
    for k, v in meta.items():
        if isinstance(v, list) and k not in _LIST_META and _numeric(v):
            meta[k] = np.asarray(v, dtype=np.float64 if "affine" in k else None)
    if meta.get("space") in {s.value for s in SpaceKeys}:
        meta["space"] = SpaceKeys(meta["space"])
    out = MetaTensor(tensor, affine=affine, meta=meta)
    if ops:
        out.applied_operations = list(ops)
    return out


def meta_template(meta: Mapping[str, Any] | None, ndim: int) -> Any:
    """A MetaTensor carrying `meta` (as `restore_meta` makes it) for tensors of `ndim` dims: build it once
    per cached tensor, then `from_template` stamps items out of it without MetaTensor's constructor."""
    import torch

    return restore_meta(torch.empty((1,) * ndim), meta)


def from_template(tensor: Any, template: Any) -> Any:
    """`tensor` as a MetaTensor with a fresh copy of the template's state (its meta dict, affine, arrays and
    applied operations are its own: MONAI transforms mutate them in place). Equals
    `restore_meta(tensor, meta)` for the meta the template was made from, at a fraction of its cost."""
    from monai.data import MetaTensor

    out = tensor.as_subclass(MetaTensor)
    out.__dict__.update({k: _fresh(v) for k, v in template.__dict__.items()})
    return out


def _fresh(value: Any) -> Any:
    """A copy of a MetaTensor attribute deep enough that no mutable part is shared with the original."""
    import torch

    if value is None or isinstance(value, (str, int, float, bool, enum.Enum)):
        return value
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    return copy.deepcopy(value)


def _numeric(value: Any) -> bool:
    if isinstance(value, list):
        return all(_numeric(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)
