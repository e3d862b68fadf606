"""The dtypes a cache stores, and the one mapping between their names, numpy dtypes and torch dtypes.

numpy has no bfloat16: a bfloat16 tensor is stored as its raw 2-byte pattern, and on the host it is a numpy
array of `BFLOAT16`, a 2-byte void dtype tagged as bfloat16 (no other dtype the cache stores is a void, so
it never compares equal to one of them, as a tagged uint16 would). Every numpy <-> torch conversion of
stored data goes through `to_numpy` / `to_tensor`, every dtype name through `dtype_name` / `np_dtype`, so
a bfloat16 head output is written, checksummed, read and viewed back as torch.bfloat16 bit for bit.
torch is imported inside the functions that need it.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np

from loaders.errors import FormatError

# Little-endian, fixed-size numeric dtypes only. The position in this tuple is the on-disk code: append only.
DTYPES: tuple[str, ...] = (
    "bool", "uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
    "float16", "float32", "float64", "bfloat16",
)  # fmt: skip
_DTYPE_CODE = {name: code for code, name in enumerate(DTYPES)}

_TAG = "blockprep_dtype"
BFLOAT16 = np.dtype("V2", metadata={_TAG: "bfloat16"})  # bfloat16's bits on the host (numpy has no bfloat16)
_BITS = {"bfloat16": BFLOAT16}  # stored names numpy has no type for -> the numpy dtype holding their bits


def dtype_name(dtype: Any) -> str:
    """The stored name of a numpy dtype ("bfloat16" for `BFLOAT16`), else numpy's name."""
    dt = np.dtype(dtype)
    tagged = (dt.metadata or {}).get(_TAG) if dt.kind == "V" else None
    return str(tagged) if tagged else dt.name


@cache
def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a stored name (memoised: entries are built per item)."""
    return _BITS.get(name) or np.dtype(name)


def dtype_code(dtype: Any) -> int:
    """On-disk code of a numpy dtype or a stored name; FormatError for dtypes the layout does not store."""
    if isinstance(dtype, str) and dtype in _BITS:
        return _DTYPE_CODE[dtype]
    dt = np.dtype(dtype)
    if dt.byteorder == ">" or (dt.byteorder == "=" and not np.little_endian):
        raise FormatError(
            f"big-endian dtype {dt.str} is not stored; convert with .astype('{dt.newbyteorder('<').str}')"
        )
    if dt.names is not None or dt.subdtype is not None:
        raise FormatError(f"structured dtype {dt} (e.g. RGB voxels) is not stored; split it into channels first")
    name = dtype_name(dt)
    if name not in _DTYPE_CODE:
        raise FormatError(f"dtype {name} is not stored; supported: {', '.join(DTYPES)}")
    return _DTYPE_CODE[name]


_TORCH_DTYPES: dict[str, Any] = {}


def torch_dtype(dtype: Any) -> Any:
    """The torch dtype of a numpy dtype the cache stores (memoised: reads ask per tensor, dtypes are few)."""
    name = dtype_name(dtype)
    got = _TORCH_DTYPES.get(name)
    if got is None:
        import torch

        got = _TORCH_DTYPES[name] = getattr(torch, name)
    return got


def to_numpy(tensor: Any) -> np.ndarray:
    """A tensor's values as a host numpy array (a view where torch allows): bfloat16 as `BFLOAT16` bits."""
    import torch

    t = tensor.detach().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(BFLOAT16)  # type: ignore[no-any-return]
    return t.numpy()  # type: ignore[no-any-return]


def to_tensor(array: np.ndarray) -> Any:
    """`to_numpy`'s inverse, sharing memory: a `BFLOAT16` array as a torch.bfloat16 tensor."""
    import torch

    if array.dtype.kind == "V" and dtype_name(array.dtype) == "bfloat16":
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(array)
