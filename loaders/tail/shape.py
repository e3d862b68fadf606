"""Deterministic transforms applied to the whole batch: `SqueezeDimd` (2D training on slices of volumes: a
one-voxel-thick crop, then its singleton dim squeezed), and those that act on each value whole or on the keys
alone (`EnsureTyped`, `CastToTyped`, `DeleteItemsd`, `CopyItemsd`: MONAI's own transform over the batch)."""

from __future__ import annotations

from typing import Any

from loaders.tail.batched import TailBatch, _plain, keys_of


def squeeze_dim(t: Any, batch: TailBatch) -> bool:
    """SqueezeDimd: every item's singleton dim `dim` removed (a view of the batch). Per item through MONAI where
    it is not a singleton (MONAI says so), for `dim=None`, or for values not batched."""
    keys = keys_of(t, batch)
    dim = t.converter.dim
    if dim is None or any(not batch.is_batched(k) for k in keys):
        return False
    at = {}
    for k in keys:
        item_ndim = batch.data[k].ndim - 1
        d = dim + item_ndim if dim < 0 else dim
        if not 0 <= d < item_ndim or batch.data[k].shape[d + 1] != 1:
            return False
        at[k] = d + 1
    for k, d in at.items():
        batch.data[k] = batch.data[k].squeeze(d)
    return True


def whole_batch(t: Any, batch: TailBatch) -> bool:
    """A deterministic transform that acts on each value whole, element by element or by its type
    (`EnsureTyped` to tensors, `CastToTyped`), or on the keys alone (`DeleteItemsd`, `CopyItemsd`): MONAI's own
    transform run once over the batch's values gives what it gives item by item, stacked. Per item through
    MONAI where a value it acts on is not batched, or for `EnsureTyped(data_type="numpy")`."""
    keys = keys_of(t, batch)
    if type(t).__name__ == "EnsureTyped" and t.converter.data_type != "tensor":
        return False
    if type(t).__name__ != "DeleteItemsd" and any(not batch.is_batched(k) for k in keys):
        return False
    out = t(dict(batch.data))
    batch.data = {k: _plain(v) if k in keys or k not in batch.data else v for k, v in out.items()}
    return True
