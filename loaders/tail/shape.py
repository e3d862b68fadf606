"""Deterministic transforms applied to the whole batch: `SqueezeDimd` (2D training on slices of volumes: a
one-voxel-thick crop, then its singleton dim squeezed), `ConcatItemsd` (the keys joined one dim later),
`AsDiscreted` (MONAI's own transform over the batch, its `dim` one later), and those that act on each value whole,
voxel by voxel, or on the keys alone (`EnsureTyped`, `ToTensord`, `CastToTyped`, `ScaleIntensityRanged`,
`ThresholdIntensityd`, `MapLabelValued`, `DeleteItemsd`, `CopyItemsd`: MONAI's own transform over the batch), and
the spatial ones that act on each channel alone (crops, pads, flips, resizes: MONAI's own transform over the batch
folded into one item's channels)."""

from __future__ import annotations

from typing import Any

from loaders.tail.tailbatch import TailBatch, _plain, batch_dim, keys_of


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
    (`EnsureTyped` and `ToTensord` to tensors, `CastToTyped`, `ScaleIntensityRanged`'s fixed ranges,
    `ThresholdIntensityd`, `MapLabelValued`), or on the keys alone (`DeleteItemsd`, `CopyItemsd`): MONAI's own
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


def concat_items(t: Any, batch: TailBatch) -> bool:
    """ConcatItemsd: the keys' tensors joined along MONAI's `dim` of each item, one dim later over the batch
    (`torch.cat`, as MONAI joins tensors). Per item through MONAI for numpy values, a missing key's error or values
    not batched."""
    import torch

    keys = keys_of(t, batch)
    if not keys or any(not batch.is_batched(k) or not isinstance(batch.data[k], torch.Tensor) for k in keys):
        return False
    batch.data[t.name] = torch.cat([batch.data[k] for k in keys], dim=batch_dim(int(t.dim)))
    return True


def as_discrete(t: Any, batch: TailBatch) -> bool:
    """AsDiscreted: MONAI's own transform over the batch's values, its `dim` (argmax, one-hot) one dim later: the
    argmax, one-hot, threshold and rounding of each item, stacked. Per item through MONAI for values not batched."""
    keys = keys_of(t, batch)
    if any(not batch.is_batched(k) for k in keys):
        return False
    kwargs = t.converter.kwargs
    given = "dim" in kwargs
    dim = kwargs.get("dim", 0)
    kwargs["dim"] = batch_dim(int(dim))
    try:
        out = t({k: batch.data[k] for k in keys})
    finally:
        if given:
            kwargs["dim"] = dim
        else:
            del kwargs["dim"]
    for k in keys:
        batch.data[k] = _plain(out[k])
    return True


def channels_folded(t: Any, batch: TailBatch) -> bool:
    """A deterministic spatial transform that acts on each channel alone, its output's shape set by its input's
    spatial shape and its own parameters, never the item's meta (`CenterSpatialCropd`, `SpatialPadd`, `Flipd`,
    `Resized`, `Rotated`, `Zoomd`, `Affined`, ...; not `Spacingd` nor `Orientationd`, which read each item's
    affine): MONAI's own transform run once, on the batch seen as one item whose channels are every item's
    channels, then split back into items. Per item through MONAI for values not batched or not tensors, and for
    `Resized` with `anti_aliasing` (its smoothing over many channels at once came out 5e-7 from MONAI's)."""
    import torch

    keys = keys_of(t, batch)
    if any(getattr(t, "anti_aliasing", ())):  # Resized's, one a key
        return False
    if any(not batch.is_batched(k) or not isinstance(batch.data[k], torch.Tensor) for k in keys):
        return False
    shapes = {k: tuple(batch.data[k].shape[:2]) for k in keys}
    out = t({k: _plain(batch.data[k]).reshape(-1, *batch.data[k].shape[2:]) for k in keys})
    for k in keys:
        v = _plain(out[k])
        batch.data[k] = v.reshape(*shapes[k], *v.shape[1:])
    return True
