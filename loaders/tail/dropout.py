"""`RandCoarseDropoutd`'s holes filled where the batch is, the host waiting once a batch.

MONAI fills an item's holes on the host: the whole item is copied down to numpy and back up (two waits and two
full copies on a GPU), and a random fill (no `fill_value`) draws between the item's min and max. Here each key's
min and max of every item come back in one read per batch; the holes and the fill numbers are drawn by MONAI's own
`randomize` and numpy's generator from the transform's own state, in MONAI's order (each item's holes, then its
fills key by key, before the next item's holes), with the same min and max; the fills are copied to the device
from pinned memory and written into a copy of the item there (numpy's float64 numbers rounded to the item's dtype,
as numpy's assignment rounds them). For float32 and float64 keys (`device.float_keys`); others go through MONAI's
own transform.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loaders.tail.device import to_device


def filled(inner: Any, img: Any, span: tuple[float, float] | None) -> Any:
    """MONAI's `RandCoarseDropout(img, randomize=False)` with its holes drawn (`span`: the item's min and max,
    for a random fill)."""
    import torch

    if not inner._do_transform:
        return img
    fill: Any = span if inner.fill_value is None else inner.fill_value
    ranged = isinstance(fill, (tuple, list))
    if inner.dropout_holes:
        out = img.clone()
        for h in inner.hole_coords:
            out[h] = _up(inner.R.uniform(fill[0], fill[1], size=tuple(out[h].shape)), out) if ranged else fill
        return out
    if ranged:
        drawn = inner.R.uniform(fill[0], fill[1], size=tuple(img.shape))
        out = _up(drawn.astype(str(img.dtype).removeprefix("torch."), copy=False), img).to(img.dtype)
    else:
        out = torch.full_like(img, fill)
    for h in inner.hole_coords:
        out[h] = img[h]
    return out


def _up(values: np.ndarray, like: Any) -> Any:
    import torch

    return to_device(torch.from_numpy(np.ascontiguousarray(values)), like.device)
