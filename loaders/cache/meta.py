"""The per-item metadata format of a prepared cache, both directions: `prep cache` encodes a head's output
with `split_output`; readers decode it with `restore_meta` / `meta_template` + `from_template`.

One meta line per item (JSON)::

    {"source": datalist entry, "section": datalist section,
     "meta": {key: MetaTensor meta}, "applied_operations": {key: [...]}, "values": {key: non-tensor output},
     "typed": 1, "kinds": {key: "ndarray" | "numpy" | "tensor"}}

With "typed", values keep their types through JSON (MONAI parity: a NIfTI header's int16/float32 fields,
tensors in applied operations, tuples, MONAI enums): numpy arrays, numpy scalars, tensors, tuples and
enums are written as small tagged objects ({"__nd__": dtype, "s": shape, "v": values}, ...) and come back
as what they were; lines without "typed" (older caches) decode as before (numeric lists to numpy arrays).
"kinds" names the stored arrays that were no MetaTensor (a numpy array, a numpy scalar, a plain tensor:
MONAI 1.4's CropForegroundd gives numpy coordinates); keys absent from it, and every key of a line written
before it, come back as MetaTensors (with meta).
The ids of applied operations are reset
to MONAI's TraceKeys.NONE, as MONAI's PersistentDataset does: an object id means nothing in another
process (and would make meta.jsonl differ between identical runs).

Each line key is named once, here. Everything heavy (torch, MONAI) is imported inside the functions.
"""

from __future__ import annotations

import copy
import enum
import json
from collections.abc import Mapping
from typing import Any

import numpy as np

from loaders.cache.dtypes import dtype_code, dtype_name, to_numpy
from loaders.cache.nesting import flatten, to_jsonable
from loaders.errors import FormatError

# meta line keys
SOURCE = "source"  # the datalist entry the item was prepared from
SECTION = "section"  # its datalist section ("training", ...)
META = "meta"  # {flat key: MetaTensor meta (JSON)}
OPS = "applied_operations"  # {flat key: MetaTensor applied_operations (JSON)}
VALUES = "values"  # {flat key: non-tensor output of the head (JSON)}
TYPED = "typed"  # 1: values are type-tagged (absent in caches written before)
KINDS = "kinds"  # {flat key: "ndarray" | "numpy" | "tensor"}: stored arrays that were no MetaTensor

_ID = "id"  # MONAI TraceKeys.ID
_NONE_ID = "none"  # MONAI TraceKeys.NONE's value: "do not match this operation to a transform by id"

# MetaTensor meta keys that are not arrays although JSON stored them as lists
_LIST_META = (OPS, "crop_center")


# --- encode (prep cache) ---
def _contiguous(array: np.ndarray) -> np.ndarray:
    """C-contiguous with the same shape: np.ascontiguousarray makes a 0-d array (a class label) 1-d."""
    return np.ascontiguousarray(array).reshape(array.shape)


def split_output(out: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Head output -> ({flat key: array}, meta line parts: per-key meta, applied operations, plain values),
    values type-tagged (see the module docstring)."""
    arrays: dict[str, np.ndarray] = {}
    meta: dict[str, Any] = {}
    ops: dict[str, Any] = {}
    values: dict[str, Any] = {}
    kinds: dict[str, str] = {}
    for key, leaf in flatten(out).items():
        if hasattr(leaf, "detach"):  # torch.Tensor or MONAI MetaTensor
            if not hasattr(leaf, "meta"):
                kinds[key] = "tensor"
            else:
                meta[key] = encode(dict(leaf.meta))
                if _strict_jsonable(getattr(leaf, "applied_operations", [])) is not None:
                    # tuples as lists: what MONAI's PersistentDataset gives back for a cached head's operations
                    ops[key] = encode(_reset_ids(list(leaf.applied_operations), _trace_none()), tuples=False)
                leaf = leaf.as_tensor()
            arrays[key] = _contiguous(to_numpy(leaf))
        elif isinstance(leaf, (np.ndarray, np.generic)):
            kinds[key] = "ndarray" if isinstance(leaf, np.ndarray) else "numpy"
            arrays[key] = _contiguous(np.asarray(leaf))
        else:
            values[key] = encode(leaf)
    for key, array in arrays.items():
        try:
            dtype_code(array.dtype)
        except FormatError as exc:
            raise FormatError(f"output '{key}': {exc}") from None
    parts: dict[str, Any] = {META: meta, TYPED: 1}
    if kinds:
        parts[KINDS] = kinds
    if ops:
        parts[OPS] = ops
    if values:
        parts[VALUES] = values
    return arrays, parts


def encode(value: Any, tuples: bool = True) -> Any:
    """`value` as JSON that `decode` turns back into the same types (numpy arrays and scalars with their
    dtype, tensors, tuples unless `tuples` is False, enums); other objects as `to_jsonable` writes them."""
    if hasattr(value, "detach"):  # torch tensor (MetaTensors in meta are stored as plain tensors)
        array = to_numpy(value)
        name = dtype_name(array.dtype)
        if name == "bfloat16":  # its values are float32 values exactly
            array = value.detach().cpu().float().numpy()
        return {"__pt__": name, "s": list(array.shape), "v": array.tolist()}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufc":
        return {"__nd__": value.dtype.name, "s": list(value.shape), "v": value.tolist()}
    if isinstance(value, np.generic) and value.dtype.kind in "biufc":
        return {"__np__": value.dtype.name, "v": value.item()}
    if isinstance(value, enum.Enum):
        kind = type(value)
        return {"__enum__": f"{kind.__module__}:{kind.__qualname__}", "v": to_jsonable(value.value)}
    if isinstance(value, Mapping):
        return {str(k): encode(v, tuples) for k, v in value.items()}
    if isinstance(value, tuple) and tuples:
        return {"__tuple__": [encode(v, tuples) for v in value]}
    if isinstance(value, (list, tuple)):
        return [encode(v, tuples) for v in value]
    return to_jsonable(value)


def _trace_none() -> Any:
    """MONAI's TraceKeys.NONE (the head that made applied operations is a MONAI one)."""
    from monai.utils import TraceKeys

    return TraceKeys.NONE


def _reset_ids(value: Any, none: Any = _NONE_ID) -> Any:
    """Applied operations with every id set to TraceKeys.NONE (as MONAI's `reset_ops_id`)."""
    if isinstance(value, (list, tuple)):
        return type(value)(_reset_ids(v, none) for v in value)
    if isinstance(value, Mapping):
        return {k: (none if k == _ID else _reset_ids(v, none)) for k, v in value.items()}
    return value


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


# What a meta line may name: a cache is untrusted input, so decoding builds only these types and never imports
# or calls what a file names (a tag naming any other type, or a nesting deeper than MAX_DEPTH, is a FormatError).
NUMERIC_DTYPES = frozenset(
    np.dtype(t).name
    for t in ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
              "float16", "float32", "float64", "complex64", "complex128")
)  # fmt: skip
ENUM_MODULE = "monai.utils.enums"  # the enums MONAI keeps in meta (SpaceKeys, TraceKeys, GridSampleMode, ...)
MAX_DEPTH = 64
_CRAFTED = "(a damaged or crafted cache; rebuild it with `prep cache --force`)"


def decode(doc: Any, depth: int = 0) -> Any:
    """The value `encode` wrote (plain JSON passes through); FormatError for a tag outside the allow-list."""
    if depth > MAX_DEPTH:
        raise FormatError(f"meta nested deeper than {MAX_DEPTH} levels (a damaged or crafted cache)")
    if isinstance(doc, list):
        return [decode(v, depth + 1) for v in doc]
    if not isinstance(doc, dict):
        return doc
    if "__nd__" in doc:
        return _array(doc, "__nd__")
    if "__np__" in doc:
        value = doc.get("v")
        if isinstance(value, (list, dict)):
            raise FormatError("meta: a numpy scalar tag holds no scalar (a damaged or crafted cache)")
        try:
            dtype = np.dtype(_dtype(doc["__np__"]))
            if dtype.kind in "iu" and isinstance(value, int) and not isinstance(value, bool):
                info = np.iinfo(dtype)  # older numpy wraps an out-of-range int (with a warning) instead of raising
                if not info.min <= value <= info.max:
                    raise OverflowError(f"outside {info.min}..{info.max}")
            return dtype.type(value)
        except (OverflowError, ValueError, TypeError) as exc:
            raise FormatError(
                f"meta: numpy scalar {str(value)[:40]!r} does not fit {doc['__np__']} ({exc}) {_CRAFTED}"
            ) from None
    if "__pt__" in doc:
        import torch

        if doc["__pt__"] == "bfloat16":
            return torch.as_tensor(_array({**doc, "__pt__": "float32"}, "__pt__")).to(torch.bfloat16)
        return torch.as_tensor(_array(doc, "__pt__"))
    if "__tuple__" in doc:
        return tuple(decode(v, depth + 1) for v in _list(doc["__tuple__"], "__tuple__"))
    if "__enum__" in doc:
        return _enum(doc["__enum__"], doc.get("v"))
    return {k: decode(v, depth + 1) for k, v in doc.items()}


def _dtype(name: Any) -> str:
    if not isinstance(name, str) or name not in NUMERIC_DTYPES:
        raise FormatError(f"meta: dtype {str(name)[:40]!r} is not a numeric dtype (a damaged or crafted cache)")
    return name


def _list(value: Any, tag: str) -> list[Any]:
    if not isinstance(value, list):
        raise FormatError(f"meta: {tag} holds no list (a damaged or crafted cache)")
    return value


def _array(doc: Mapping[str, Any], tag: str) -> np.ndarray:
    """A tagged array, only from the values the line holds: the shape must account for them exactly."""
    dtype, shape = _dtype(doc[tag]), doc.get("s")
    if not isinstance(shape, list) or len(shape) > 32 or not all(type(d) is int and d >= 0 for d in shape):
        raise FormatError(f"meta: {tag} shape {str(shape)[:40]} is not a list of sizes (a damaged or crafted cache)")
    try:
        if _holds_null(doc.get("v")):  # numpy would read a null as NaN; `encode` never writes one
            raise ValueError("null is not a number")
        array = np.asarray(doc.get("v"), dtype=dtype)
    except (TypeError, ValueError, OverflowError) as exc:
        raise FormatError(f"meta: {tag} values do not fit {dtype} ({exc}) (a damaged or crafted cache)") from exc
    count = 1
    for d in shape:  # Python ints: no wrap-around
        count *= d
    if count != array.size:
        raise FormatError(
            f"meta: {tag} shape {shape} does not hold its {array.size} values (a damaged or crafted cache)"
        )
    return array.reshape(shape)


def _holds_null(value: Any, depth: int = 0) -> bool:
    if value is None:
        return True
    return isinstance(value, list) and depth <= MAX_DEPTH and any(_holds_null(v, depth + 1) for v in value)


def _enum(name: Any, value: Any) -> Any:
    """The member `value` of MONAI's enum class "monai.utils.enums:Name"; FormatError for any other name or
    member. Only a class of that one module that is an Enum is looked up: nothing a file names is imported
    or called. Without MONAI installed the plain value comes back (nothing to check it against)."""
    module, _, qualname = name.partition(":") if isinstance(name, str) else ("", "", "")
    if module != ENUM_MODULE or not qualname.isidentifier() or qualname.startswith("_"):
        raise FormatError(f"meta: enum tag {str(name)[:60]!r} is not a class of {ENUM_MODULE} {_CRAFTED}")
    try:
        from monai.utils import enums
    except ImportError:
        return value
    kind = vars(enums).get(qualname)
    if not (isinstance(kind, type) and issubclass(kind, enum.Enum) and len(kind.__members__)):
        raise FormatError(f"meta: enum tag {name[:60]!r} is not an enum of {ENUM_MODULE} {_CRAFTED}")
    try:
        return kind(value)
    except (ValueError, TypeError):
        raise FormatError(f"meta: {str(value)[:40]!r} is not a member of {qualname} {_CRAFTED}") from None


_KIND_NAMES = ("ndarray", "numpy", "tensor")
MAX_AFFINE_ROWS = 4  # MONAI's affines: spatial rank 1..3, homogeneous


def check_line(line: Mapping[str, Any]) -> str | None:
    """Why a parsed meta line's parts do not have the shape readers take apart, or None: "meta" an object of
    objects, "applied_operations" an object of lists of objects, "values" an object, "kinds" an object of
    kind names, "section" a string (null allowed for each part)."""
    shapes = ((META, dict, dict), (OPS, dict, list), (VALUES, dict, None), (KINDS, dict, str))
    for part, outer, inner in shapes:
        value = line.get(part)
        if value is None:
            continue
        if not isinstance(value, outer):
            return f"'{part}' is a {type(value).__name__}, not an object"
        for key, v in value.items():
            if inner is not None and v is not None and not isinstance(v, inner):
                return f"'{part}' of '{str(key)[:40]}' is a {type(v).__name__}, not a {inner.__name__}"
    for ops in (line.get(OPS) or {}).values():
        if any(not isinstance(op, dict) for op in ops or ()):
            return f"'{OPS}' holds an operation that is not an object"
    if any(v not in _KIND_NAMES for v in (line.get(KINDS) or {}).values()):
        return f"'{KINDS}' names a kind other than {', '.join(_KIND_NAMES)}"
    if not isinstance(line.get(SECTION, ""), (str, type(None))):
        return f"'{SECTION}' is not a string"
    return None


def check_affine(affine: Any, ndim: int) -> Any:
    """`affine` as a float64 tensor, if it is one MONAI could have given a `ndim`-D tensor: square, of 2..4
    rows (MONAI gives 2-D images a 4x4 one too), with no fewer spatial dimensions than the tensor's (up to
    3, a channel first). FormatError otherwise: a crafted affine would place every voxel wrongly, unseen."""
    import torch

    try:
        matrix = torch.as_tensor(np.asarray(affine, dtype=np.float64))
    except (TypeError, ValueError) as exc:
        raise FormatError(f"meta: the affine is no matrix of numbers ({str(exc)[:60]}) {_CRAFTED}") from None
    rows = matrix.shape[0] if matrix.ndim == 2 and matrix.shape[0] == matrix.shape[1] else 0
    if not 2 <= rows <= MAX_AFFINE_ROWS or rows - 1 < min(3, ndim - 1):
        raise FormatError(
            f"meta: an affine of shape {tuple(matrix.shape)} does not fit a {ndim}-D tensor (square, 2..4 rows, "
            f"at least {min(3, ndim - 1) + 1}) {_CRAFTED}"
        )
    return matrix


def key_meta(line: Mapping[str, Any] | None, key: str) -> dict[str, Any]:
    """The MetaTensor meta of flat key `key` (falling back to its top-level key), applied operations in."""
    line = line or {}
    metas = line.get(META) or {}
    meta = dict(metas.get(key, metas.get(key.split("/")[0])) or {})
    ops = (line.get(OPS) or {}).get(key)
    if ops is not None:
        meta[OPS] = ops
    if line.get(TYPED):
        return decode(meta)  # type: ignore[no-any-return]
    if OPS in meta:  # written before "typed": ids of another process
        meta[OPS] = _reset_ids(meta[OPS])
    return meta


def line_values(line: Mapping[str, Any] | None) -> dict[str, Any]:
    """The head's non-tensor outputs stored in a meta line."""
    values = dict((line or {}).get(VALUES) or {})
    return decode(values) if (line or {}).get(TYPED) else values  # type: ignore[no-any-return]


def values_text(line: Mapping[str, Any] | None) -> str:
    """The line's non-tensor outputs as one text (still type-tagged) that `values_from_text` turns into a fresh
    copy each time: a reader hands every read its own values without keeping a decoded object to deep-copy
    (a JSON dump of the decoded values would lose what JSON has no type for: enums, tuples, arrays)."""
    values = (line or {}).get(VALUES) or {}
    return ("T" if (line or {}).get(TYPED) else "U") + json.dumps(values)


def values_from_text(text: str) -> dict[str, Any]:
    """The values `values_text` wrote, decoded with their types."""
    values = json.loads(text[1:])
    return decode(values) if text[0] == "T" and "__" in text else values  # type: ignore[no-any-return]


def line_kinds(line: Mapping[str, Any] | None) -> dict[str, str]:
    """{flat key: "ndarray" | "numpy" | "tensor"} of the stored arrays that were no MetaTensor."""
    return dict((line or {}).get(KINDS) or {})


def as_kind(tensor: Any, kind: str | None, template: Any = None) -> Any:
    """A read tensor as the head gave it: a numpy array or scalar (on the host, dtype kept), a plain tensor,
    else a MetaTensor stamped from `template` (`from_template`), or the tensor itself without one."""
    if kind in ("ndarray", "numpy"):
        array = tensor.detach().cpu().numpy()
        return array.reshape(())[()] if kind == "numpy" else array  # a scalar: shape (), or (1,) in older caches
    if kind == "tensor" or template is None:
        return tensor
    return from_template(tensor, template)


def line_source(line: Mapping[str, Any] | None) -> Any:
    """The datalist entry a meta line was prepared from."""
    return (line or {}).get(SOURCE)


def entry_key(section: Any, entry: Any) -> str:
    """What identifies a prepared item: its section and its resolved entry (file paths included), as JSON; the
    entry is what MONAI's PersistentDataset hashes to name an item's file."""
    return json.dumps([section, entry], sort_keys=True, default=str)


def line_meta(line: Mapping[str, Any] | None) -> dict[str, Any]:
    """{flat key: MetaTensor meta} (applied operations apart), values with their types."""
    metas = dict((line or {}).get(META) or {})
    return decode(metas) if (line or {}).get(TYPED) else metas  # type: ignore[no-any-return]


def restore_meta(tensor: Any, meta: Mapping[str, Any] | None) -> Any:
    """Wrap a tensor as a MONAI MetaTensor with its meta (as `key_meta` decodes it). Untyped meta (caches
    written before "typed") gets LoadImage's types where they can be guessed: affine a float64 tensor,
    numeric lists numpy arrays, space a SpaceKeys."""
    from monai.data import MetaTensor
    from monai.utils import SpaceKeys

    meta = dict(meta or {})
    ops = meta.pop(OPS, None)
    affine = meta.pop("affine", None)
    if affine is not None:  # a list when written before "typed"
        affine = check_affine(affine, tensor.ndim)
    for k, v in meta.items():
        if isinstance(v, list) and k not in _LIST_META and _numeric(v):
            meta[k] = np.asarray(v, dtype=np.float64 if "affine" in k else None)
    if isinstance(meta.get("space"), str) and meta["space"] in {s.value for s in SpaceKeys}:
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
