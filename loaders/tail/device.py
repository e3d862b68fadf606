"""The tail on a CUDA device: the stream it runs on, host tensors copied up without the host waiting, rows picked
by an index on the device, and the items' ranges read by the host at once."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from loaders.tail.graphs import host_read, keep

if TYPE_CHECKING:
    from loaders.tail.tailbatch import TailBatch


def to_device(value: Any, device: Any) -> Any:
    """A small host tensor (factors, matrices, noise) on `device` without stalling the host.

    A CUDA copy from pageable memory first waits for all work queued on the stream (the previous training
    step); from pinned memory it is asynchronous. The caching host allocator keeps the pinned block alive
    until the copy is done.
    """
    import torch

    device = torch.device(device)
    if device.type != "cuda" or value.device == device:
        return value.to(device)
    pinned = value.pin_memory()
    keep(pinned)  # inside a captured segment, the copy runs when the segment does
    return pinned.to(device, non_blocking=True)


def tail_stream(device: Any) -> Any:
    """The CUDA stream a loader's tail runs on, at the device's highest priority.

    MONAI's transforms make the host wait for their own kernels (a `.item()`, a `float()` of a device tensor, a
    copy from pageable memory): several times a batch on `seg-aug`, `slices` and `seg-elastic`. At the default
    priority those kernels queue behind the training step's, so each wait lasts until the GPU gets to them; at
    the highest, the GPU schedules them first and the wait is their own run time. The numbers are the same.
    """
    import torch

    try:
        return torch.cuda.Stream(device=device, priority=-16)  # past the highest: torch takes its highest
    except (RuntimeError, ValueError):  # a torch that refuses values past its range
        return torch.cuda.Stream(device=device, priority=-1)


class Picked(Sequence[int]):
    """The rows of a batch that fired, as an index on its device (made from the mask where the work runs: no host
    number in it, so one graph serves every choice of `len` rows). `rows_of` picks them; an op on them works on
    positions 0..len-1 of what it picks."""

    def __init__(self, index: Any) -> None:
        self.at = index

    def __len__(self) -> int:
        return int(self.at.shape[0])

    def __getitem__(self, i: Any) -> Any:
        raise TypeError("Picked rows are a device index: pick with rows_of, then work by position")


def fired_index(fired: Any, count: int) -> Any:
    """The indices of the `count` true entries of the (n,) bool mask `fired`, in order, made where it is (elementwise
    ops and a sum: nothing read back, and the same kernels whichever entries are true)."""
    import torch

    n = int(fired.shape[0])
    at = torch.cumsum(fired.to(torch.int64), 0) - 1  # each fired row's place among the fired
    slots = torch.arange(count, dtype=torch.int64, device=fired.device)
    hit = (at.unsqueeze(0) == slots.unsqueeze(1)) & fired.unsqueeze(0)  # (count, n): row i is the j-th fired
    return (hit.to(torch.int64) * torch.arange(n, dtype=torch.int64, device=fired.device)).sum(1)


def rows_of(x: Any, rows: Sequence[int]) -> Any:
    """`x[rows]` along the batch dim: by the rows' device index (`Picked`), or a list's index uploaded without the
    host waiting (a list index is copied to the device from pageable memory: the host waits for the work queued
    before it)."""
    import torch

    if isinstance(rows, Picked):
        return x.index_select(0, rows.at)
    if list(rows) == list(range(x.shape[0])):
        return x
    return x.index_select(0, to_device(torch.as_tensor(list(rows), dtype=torch.long), x.device))


def float_keys(batch: TailBatch, keys: Sequence[Hashable]) -> bool:
    """Whether every key of the batch is float32 or float64 (what the host-side steps of a few transforms are
    written for)."""
    return all(str(batch.data[k].dtype) in ("torch.float32", "torch.float64") for k in keys)


def device_spans(batch: TailBatch, keys: Sequence[Hashable]) -> dict[Hashable, list[tuple[Any, Any]]]:
    """Each key's (min, max) of every item as 0-dim float64 tensors where the batch is: nothing read back."""
    out: dict[Hashable, list[tuple[Any, Any]]] = {}
    for k in keys:
        both = row_spans(batch.data[k])
        out[k] = [(both[i, 0], both[i, 1]) for i in range(batch.n)]
    return out


def row_spans(x: Any) -> Any:
    """Each item's (min, max) of a batch tensor, (n, 2) float64 where it is."""
    import torch

    flat = x.reshape(x.shape[0], -1)
    return torch.stack([flat.amin(1), flat.amax(1)], 1).to(torch.float64)


def item_spans(batch: TailBatch, keys: Sequence[Hashable]) -> dict[Hashable, list[tuple[float, float]]]:
    """Each key's (min, max) of every item, read back at once (one host wait a batch, not two an item): what a
    MONAI transform reads of an item to draw or compute on the host."""
    import torch

    with host_read(batch):
        flat = [batch.data[k].reshape(batch.n, -1) for k in keys]
        both = torch.cat([torch.stack([f.amin(1), f.amax(1)], 1).to(torch.float64) for f in flat]).tolist()
    return {k: [(lo, hi) for lo, hi in both[j * batch.n : (j + 1) * batch.n]] for j, k in enumerate(keys)}
