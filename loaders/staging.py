"""Staging: where a read's bytes land and how they become tensors on the reader's device.

- `Slot`: a pinned, 4 KiB-aligned host slot of a `loaders.gpu.PinnedStager`, what a host backend reads into
  when a GPU is fed (one async copy up, on the stager's stream);
- `upload`: the one host-to-device step: a read buffer as one flat uint8 tensor on the device (a pinned
  slot: one async copy; a GPU backend's buffer: wrapped in place; host memory on the CPU: zero-copy);
- `host_array`: the one place that tells a device buffer (cupy, torch CUDA) from a host one;
- `torch_dtype`, `view`, `packed_view`, `stack`: bytes of a flat buffer as typed tensors, and a batch's
  tensors stacked (or padded, or left a list when shapes differ).

`import loaders.staging` imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

_TORCH_DTYPES: dict[np.dtype, Any] = {}


def torch_dtype(dtype: np.dtype) -> Any:
    """The torch dtype of a numpy dtype the cache stores (memoised: reads ask per tensor, dtypes are few)."""
    got = _TORCH_DTYPES.get(dtype)
    if got is None:
        import torch

        got = _TORCH_DTYPES[dtype] = {
            "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "uint16": torch.uint16,
            "int16": torch.int16, "uint32": torch.uint32, "int32": torch.int32, "uint64": torch.uint64,
            "int64": torch.int64, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
        }[np.dtype(dtype).name]  # fmt: skip
    return got


def host_array(buf: Any) -> np.ndarray:
    """`buf`'s bytes as a host numpy array: a device buffer (cupy array, torch CUDA tensor) is copied down,
    host memory is viewed. The one place that tells the two apart."""
    if isinstance(buf, np.ndarray):
        return buf
    if hasattr(buf, "get"):  # cupy
        return np.asarray(buf.get())
    if hasattr(buf, "cpu"):  # torch
        return np.asarray(buf.cpu().numpy())
    return np.asarray(buf)


@dataclass(frozen=True)
class Slot:
    """Staging slot `index` (modulo its count) of a `loaders.gpu.PinnedStager`."""

    stager: Any
    index: int

    def host(self, nbytes: int) -> np.ndarray:
        """The slot's pinned host memory, free to overwrite (waits for the slot's last copy)."""
        return self.stager.host(self.index % self.stager.slots, nbytes)  # type: ignore[no-any-return]


def upload(buf: Any, nbytes: int, slot: Slot | None, on_device: bool, device: Any) -> Any:
    """The first `nbytes` of a read buffer as one flat uint8 tensor on `device`: from a pinned `slot` one async
    copy on its stream, a device buffer (`on_device`, a GPU backend's) wrapped, host memory viewed."""
    import torch

    if slot is not None:
        return slot.stager.upload(slot.index % slot.stager.slots, nbytes)
    if on_device:
        return torch.as_tensor(buf[:nbytes], device=device)
    return torch.from_numpy(np.asarray(buf[:nbytes]))


def values_to(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    """`batch` with its collated host tensors (class labels and other numbers of the head or the tail) on the
    GPU `device` too, copied from pinned memory on the current stream: a training loop's `.to(device)` of a
    pageable tensor would wait for every step queued before it. `_items` stays on the host."""
    import torch

    for key, value in batch.items():
        if key != "_items" and isinstance(value, torch.Tensor) and value.device.type == "cpu":
            batch[key] = value.pin_memory().to(device, non_blocking=True)
    return batch


def view(flat: Any, at: int, dtype: np.dtype, shape: tuple[int, ...]) -> Any:
    """The tensor of `dtype` and `shape` at byte `at` of a flat uint8 tensor (a view)."""
    nbytes = math.prod(shape) * np.dtype(dtype).itemsize
    return flat[at : at + nbytes].view(torch_dtype(dtype)).reshape(shape)


def packed_view(flat: Any, run: list[tuple[Any, str, int, np.dtype, tuple[int, ...]]]) -> Any:
    """The tensors of `run` (places: tag, key, byte offset, dtype, shape) as one (len(run), ...) view of `flat`
    when they are of one key, dtype and shape and lie back to back in order; None otherwise."""
    _, key, at, dtype, shape = run[0]
    nb = math.prod(shape) * np.dtype(dtype).itemsize
    if at % np.dtype(dtype).itemsize or any(
        p[1] != key or p[2] != at + i * nb or p[3] != dtype or p[4] != shape for i, p in enumerate(run)
    ):
        return None
    return flat[at : at + len(run) * nb].view(torch_dtype(dtype)).reshape(len(run), *shape)


def stack(tensors: list[Any], pad: bool = False, shapes: dict[str, Any] | None = None, key: str = "") -> Any:
    """Equal shapes: one stacked tensor. Unequal: the list, or with `pad` one tensor of the largest shape
    (each zero-padded at the end of every dim), the items' own shapes put in `shapes[key]` (B, ndim)."""
    import torch

    first = tensors[0]
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        return tensors  # values the tail saw (names, labels) stay a list
    if all(t.shape == first.shape for t in tensors):
        return torch.stack(tensors)
    if not pad or any(t.dim() != first.dim() for t in tensors):
        return list(tensors)
    size = [max(t.shape[d] for t in tensors) for d in range(first.dim())]
    out = torch.zeros((len(tensors), *size), dtype=first.dtype, device=first.device)
    for b, t in enumerate(tensors):
        index: tuple[Any, ...] = (b, *(slice(0, n) for n in t.shape))
        out[index] = t
    if shapes is not None:
        shapes[key] = torch.tensor([list(t.shape) for t in tensors])
    return out
