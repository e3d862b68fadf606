"""`RandGaussianSharpend` on the items it fires on: their filters' kernels made at once, without the host waiting.

MONAI's `GaussianSharpen` builds two `GaussianFilter`s per item and moves them to the image's device (each sigma
copied from pageable memory: the host waits), and each filter's `gaussian_1d` then reads its sigma back
(`float(sigma)`, for the kernel's length: the host waits again) and makes its kernel in a dozen small ops: per
3D item twelve waits and about seventy kernels before any filtering. Here every fired item's sigmas (the same
float32 numbers) go to the device in one copy from pinned memory, and for MONAI's default "erf" kernels every
kernel of the batch is made at once: one row per sigma over the longest kernel's positions, each row's kernel
the centred slice of its own length. The ops are `gaussian_1d`'s, element by element (on a CUDA device an
element's value does not depend on where in the tensor it lies), so each slice is the kernel MONAI makes. Other
approximations, and the CPU, run MONAI's own `gaussian_1d` per sigma, handed a device tensor that knows its host
value. MONAI's `separable_filtering` and the sharpening sum then run on each item as `GaussianSharpen` runs
them: the same ops, the same numbers.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loaders.tail.device import to_device

_KNOWN: Any = None
TRUNCATED = 4.0  # GaussianFilter's default, which GaussianSharpen uses


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


def filter_kernels(approx: str, drawn: list[Mapping[str, Any]], nd: int, device: Any) -> list[list[Any]]:
    """Each drawn item's 2 * nd kernels (its first filter's, then its second's), as MONAI's `GaussianFilter`s
    for its sigmas make them on `device`."""
    import torch
    from monai.networks.layers.convutils import gaussian_1d
    from monai.utils import ensure_tuple_size

    sigmas: list[Any] = []
    for d in drawn:
        if d["x2"] is None or d["y2"] is None or d["z2"] is None or d["a"] is None:
            raise RuntimeError("please call the `randomize()` function first.")
        for part in ((d["x1"], d["y1"], d["z1"]), (d["x2"], d["y2"], d["z2"])):
            sigmas.extend(ensure_tuple_size(vals=part, dim=nd))
    if not sigmas:
        return [[] for _ in drawn]
    host = torch.as_tensor([float(s) for s in sigmas], dtype=torch.float)  # GaussianFilter's float32 sigmas
    values = host.tolist()
    on_device = to_device(host, device)
    if approx.lower() == "erf" and on_device.is_cuda:  # a CPU kernel's elements past its last vector run apart
        made = _erf_kernels(on_device, values)
    else:
        made = [gaussian_1d(_known(on_device[j], v), truncated=TRUNCATED, approx=approx) for j, v in enumerate(values)]
    per = 2 * nd
    return [made[j * per : (j + 1) * per] for j in range(len(drawn))]


def _erf_kernels(sigma: Any, values: list[float]) -> list[Any]:
    """`gaussian_1d(s, 4.0, "erf")` for every sigma at once: row j over the longest kernel's positions, its
    kernel the centred slice of its own length (`values`: the sigmas' host numbers)."""
    import torch

    tails = [int(max(v * TRUNCATED, 0.5) + 0.5) for v in values]
    most = max(tails)
    x = torch.arange(-most, most + 1, dtype=torch.float, device=sigma.device)
    t = 0.70710678 / torch.abs(sigma.reshape(-1, 1))
    out = 0.5 * ((t * (x + 0.5)).erf() - (t * (x - 0.5)).erf())
    out = out.clamp(min=0)
    return [out[j, most - tail : most + tail + 1] for j, tail in enumerate(tails)]


def sharpened(inner: Any, img: Any, kernels: list[Any]) -> Any:
    """MONAI's `RandGaussianSharpen(img, randomize=False)` with the draws `inner` holds and its filters' kernels
    (img: one item, channel first, a plain tensor)."""
    import torch
    from monai.networks.layers.simplelayers import separable_filtering

    if not inner._do_transform:
        return img
    nd = img.ndim - 1
    x = img.to(torch.float32)
    blurred = separable_filtering(x=x.unsqueeze(0), kernels=kernels[:nd])
    twice = separable_filtering(x=blurred, kernels=kernels[nd:])
    return (blurred + inner.a * (blurred - twice)).squeeze(0)
