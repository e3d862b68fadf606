"""`RandGaussianSharpend` on an item it fires on, without the host waiting for the GPU.

MONAI's `GaussianSharpen` builds two `GaussianFilter`s and moves them to the image's device (each sigma copied from
pageable memory: the host waits), and each filter's `gaussian_1d` then reads its sigma back (`float(sigma)`, for
the kernel's length: the host waits again): twelve waits an item in 3D, ten of `seg-aug`'s seventeen a batch.
Here the filters are built by MONAI on the host, their sigmas copied to the device at once from pinned memory,
and each handed to MONAI's own `gaussian_1d` as a device tensor that also knows its value on the host (the same
float32 number: what `float()` of it returns, without reading it back). MONAI's `separable_filtering` and the
sharpening sum then run as `GaussianFilter.forward` and `GaussianSharpen` run them: the same ops, the same numbers.
"""

from __future__ import annotations

from typing import Any

from loaders.tail.device import to_device

_KNOWN: Any = None


def _known(value: Any, host: float) -> Any:
    """`value` (a 0-dim device tensor) whose `float()` is `host`, its other ops plain tensors'."""
    global _KNOWN
    if _KNOWN is None:
        import torch

        class Known(torch.Tensor):
            __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
            host: float

            def __float__(self) -> float:
                return self.host

        _KNOWN = Known
    out = value.as_subclass(_KNOWN)
    out.host = host
    return out


def sharpened(inner: Any, img: Any) -> Any:
    """MONAI's `RandGaussianSharpen(img, randomize=False)` with the draws `inner` holds (img: one item, channel
    first, a plain tensor)."""
    import torch
    from monai.networks.layers import GaussianFilter
    from monai.networks.layers.convutils import gaussian_1d
    from monai.networks.layers.simplelayers import separable_filtering
    from monai.utils import ensure_tuple_size

    if not inner._do_transform:
        return img
    if inner.x2 is None or inner.y2 is None or inner.z2 is None or inner.a is None:
        raise RuntimeError("please call the `randomize()` function first.")
    nd = img.ndim - 1
    filters = [
        GaussianFilter(nd, ensure_tuple_size(vals=sigmas, dim=nd), approx=inner.approx)
        for sigmas in ((inner.x1, inner.y1, inner.z1), (inner.x2, inner.y2, inner.z2))
    ]
    host = [s.detach() for f in filters for s in f.sigma]
    on_device = to_device(torch.stack(host), img.device)
    sigmas = [_known(on_device[j], float(h)) for j, h in enumerate(host)]
    kernels = [
        [gaussian_1d(s, truncated=f.truncated, approx=f.approx) for s in part]
        for f, part in zip(filters, (sigmas[: len(filters[0].sigma)], sigmas[len(filters[0].sigma) :]))
    ]
    x = img.to(torch.float32)
    blurred = separable_filtering(x=x.unsqueeze(0), kernels=kernels[0])
    twice = separable_filtering(x=blurred, kernels=kernels[1])
    return (blurred + inner.a * (blurred - twice)).squeeze(0)
