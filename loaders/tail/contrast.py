"""`RandAdjustContrastd` on the items it fires on, the host never waiting on a GPU, once a batch on the CPU.

MONAI's `AdjustContrast` divides by a host number, `float(img_range + epsilon)`: a read back of each item (and
each key). On a CUDA device torch divides a tensor by a host number as a multiplication by the number's
reciprocal, computed in the tensor's precision; here that reciprocal is computed on the device from the range
plus epsilon there (IEEE division, as the host computes it: the same number), so nothing is read back. On the
CPU (a plain division there) every item's min and max come back in one read a batch, and the range plus epsilon
is computed on the host in the item's dtype (IEEE subtraction and addition: the same number). MONAI's other
steps run on the item as MONAI runs them, op for op: the inversion, the stats it keeps, the power, the scaling
back. For float32 and float64 keys; others go through MONAI's own transform.
"""

from __future__ import annotations

from typing import Any

import numpy as np

EPSILON = 1e-7  # MONAI's AdjustContrast


def host_range(span: tuple[float, float], dtype: Any, invert: bool) -> float:
    """`float(img.max() - img.min() + 1e-7)` of an item whose min and max are `span`, in its dtype."""
    kind = np.dtype(str(dtype).removeprefix("torch."))
    lo, hi = (kind.type(-span[1]), kind.type(-span[0])) if invert else (kind.type(span[0]), kind.type(span[1]))
    return float((hi - lo) + kind.type(EPSILON))


def adjusted(inner: Any, img: Any, span: tuple[float, float] | None) -> Any:
    """MONAI's `RandAdjustContrast(img, randomize=False)` with the gamma `inner` drew (`span`: the item's min and
    max, read by the host; None on a CUDA device)."""
    import torch

    if not inner._do_transform:
        return img
    if inner.gamma_value is None:
        raise RuntimeError("gamma_value is not set, please call `randomize` function first.")
    a, gamma = inner.adjust_contrast, inner.gamma_value
    if a.invert_image:
        img = -img
    if a.retain_stats:
        mn = img.mean()
        sd = img.std()
    img_min = img.min()
    img_range = img.max() - img_min
    if span is None:  # torch's CUDA division by a host number: times its reciprocal
        scaled = (img - img_min) * torch.reciprocal(img_range + EPSILON)
    else:
        scaled = (img - img_min) / host_range(span, img.dtype, a.invert_image)
    ret = scaled**gamma * img_range + img_min
    if a.retain_stats:
        ret = ret - ret.mean()
        ret = ret / (ret.std() + 1e-8)
        ret = sd * ret + mn
    if a.invert_image:
        ret = -ret
    return ret
