"""Deterministic transforms that change a batch's shape, applied to the whole batch: `SqueezeDimd` (2D
training on slices of volumes: a one-voxel-thick crop, then its singleton dim squeezed)."""

from __future__ import annotations

from typing import Any

from loaders.tail.batched import TailBatch, keys_of


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
