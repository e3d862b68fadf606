"""`RandGaussianSharpend` on the items it fires on: their filters' kernels made at once, without the host waiting.

MONAI's `GaussianSharpen` builds two `GaussianFilter`s per item, moves them to the image's device and makes their
kernels: per 3D item twelve host waits and about seventy kernels before any filtering. Here every fired item's
kernels are made at once (`loaders.tail.gauss`: the same numbers), and MONAI's `separable_filtering` and the
sharpening sum then run on each item as `GaussianSharpen` runs them: the same ops, the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loaders.tail import gauss

TRUNCATED = 4.0  # GaussianFilter's default, which GaussianSharpen uses


def filter_kernels(approx: str, drawn: list[Mapping[str, Any]], nd: int, device: Any) -> list[list[Any]]:
    """Each drawn item's 2 * nd kernels (its first filter's, then its second's), as MONAI's `GaussianFilter`s
    for its sigmas make them on `device`."""
    sigmas = [s for d in drawn for s in sigmas_of(d, nd)]
    made = gauss.kernels(sigmas, TRUNCATED, approx, device)
    per = 2 * nd
    return [made[j * per : (j + 1) * per] for j in range(len(drawn))]


def sigmas_of(drawn: Mapping[str, Any], nd: int) -> list[Any]:
    """An item's 2 * nd sigmas as `GaussianSharpen` hands them to its two filters (the first's, then the second's)."""
    from monai.utils import ensure_tuple_size

    d = drawn
    if d["x2"] is None or d["y2"] is None or d["z2"] is None or d["a"] is None:
        raise RuntimeError("please call the `randomize()` function first.")
    out: list[Any] = []
    for part in ((d["x1"], d["y1"], d["z1"]), (d["x2"], d["y2"], d["z2"])):
        out.extend(ensure_tuple_size(vals=part, dim=nd))
    return out


def sharpened_with(x: Any, kernels: list[Any], a: Any) -> Any:
    """`GaussianSharpen`'s filtering and sum on x (a batch of one, channel first) with its filters' kernels and its
    weight `a` (a float, or a float32 tensor of the float's number: the same product)."""
    nd = x.ndim - 2
    return sharpened_from(blurred_with(x, kernels[:nd]), kernels[nd:], a)


def blurred_with(x: Any, kernels: list[Any]) -> Any:
    """`GaussianSharpen`'s first filtering: x in float32 through its first filter's kernels."""
    import torch
    from monai.networks.layers.simplelayers import separable_filtering

    return separable_filtering(x=x.to(torch.float32), kernels=kernels)


def sharpened_from(blurred: Any, kernels: list[Any], a: Any) -> Any:
    """`GaussianSharpen`'s second filtering of the first's output and its sum, with the second filter's kernels."""
    from monai.networks.layers.simplelayers import separable_filtering

    twice = separable_filtering(x=blurred, kernels=kernels)
    return blurred + a * (blurred - twice)


def sharpened(inner: Any, img: Any, kernels: list[Any]) -> Any:
    """MONAI's `RandGaussianSharpen(img, randomize=False)` with the draws `inner` holds and its filters' kernels
    (img: one item, channel first, a plain tensor)."""
    if not inner._do_transform:
        return img
    return sharpened_with(img.unsqueeze(0), kernels, inner.a).squeeze(0)
