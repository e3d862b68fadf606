"""`RandHistogramShiftd`'s mapping for every item it fires on at once.

MONAI maps an item in its own steps (`HistogramShift.interp`, torch backend): the image's min and max, the control
points scaled between them, each segment's slope and offset, a sorted search for every voxel's segment, the line,
then the voxels below the first point and above the last set to the end values. Each step is elementwise per item
(or a min and max, which do not depend on the order of a reduction), so the items' rows side by side give MONAI's
numbers; MONAI's per-item host waits (the min compared with the max, the points copied from host memory, two
masked writes) go. An item whose image is one value stays as it is, as MONAI leaves it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from loaders.tail.device import rows_of, to_device


def shifted(x: Any, rows: list[int], draws: list[dict[str, Any]]) -> list[Any]:
    """Rows `rows` of `x` (a batch, floating) mapped with their draws (the inner transform's attributes after
    its `randomize`), in that order; items grouped by their count of control points."""
    picked = rows_of(x, rows)
    out = list(picked.unbind(0))
    groups: dict[int, list[int]] = {}
    for j, d in enumerate(draws):
        if d.get("_do_transform", True):
            groups.setdefault(len(d["reference_control_points"]), []).append(j)
    for js in groups.values():
        part = picked if len(js) == len(rows) else rows_of(picked, js)
        for j, row in zip(js, _mapped(part, [draws[j] for j in js]).unbind(0)):
            out[j] = row
    return out


def _points(draws: list[dict[str, Any]], name: str, like: Any) -> Any:
    import torch

    return to_device(torch.as_tensor(np.stack([d[name] for d in draws]), dtype=like.dtype), like.device)


def _mapped(img: Any, draws: list[dict[str, Any]]) -> Any:
    return mapped(img, _points(draws, "reference_control_points", img), _points(draws, "floating_control_points", img))


def mapped(img: Any, reference: Any, floating: Any) -> Any:
    """Each row of `img` mapped by its control points (rows of `reference` and `floating`, in its dtype, on its
    device)."""
    import torch

    flat = img.reshape(img.shape[0], -1)
    low, high = flat.amin(1, keepdim=True), flat.amax(1, keepdim=True)
    span = high - low
    xp = reference * span + low
    fp = floating * span + low
    m = (fp[:, 1:] - fp[:, :-1]) / (xp[:, 1:] - xp[:, :-1])
    b = fp[:, :-1] - (m * xp[:, :-1])
    at = (torch.searchsorted(xp.contiguous(), flat.contiguous()) - 1).clip(0, m.shape[1] - 1)
    f = torch.gather(m, 1, at) * flat + torch.gather(b, 1, at)
    f = torch.where(flat < xp[:, :1], fp[:, :1], f)
    f = torch.where(flat > xp[:, -1:], fp[:, -1:], f)
    one_value = (low == high).reshape(-1, *([1] * (img.ndim - 1)))
    return torch.where(one_value, img, f.reshape(img.shape))
