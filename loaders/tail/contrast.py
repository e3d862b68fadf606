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
    if not inner._do_transform:
        return img
    if inner.gamma_value is None:
        raise RuntimeError("gamma_value is not set, please call `randomize` function first.")
    return contrasted(inner.adjust_contrast, img, inner.gamma_value, span)


def contrasted(a: Any, img: Any, gamma: Any, span: tuple[float, float] | None) -> Any:
    """MONAI's `AdjustContrast` `a` with `gamma` (a host number, or a device tensor of one: torch's power of a
    tensor by either is the same `pow`, for exponents other than the few it computes otherwise, 0.5, 2, 3, -0.5, -1
    and -2, which a drawn gamma is not) on one item."""
    import torch

    if isinstance(gamma, torch.Tensor):  # the host's number: on a CUDA device torch's power takes it in the
        gamma = gamma.to(img.dtype) if img.is_cuda else float(gamma)  # image's dtype; the CPU's otherwise
    if a.invert_image:
        img = -img
    if a.retain_stats:
        mn = img.mean()
        sd = img.std()
    img_min = img.min()
    img_range = img.max() - img_min
    if span is None and img.is_cuda:  # torch's CUDA division by a host number: times its reciprocal
        scaled = (img - img_min) * torch.reciprocal(img_range + EPSILON)
    elif span is None:  # elsewhere MONAI's own division, reading the range
        scaled = (img - img_min) / float(img_range + EPSILON)
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
