"""MONAI's 1D Gaussian kernels (`gaussian_1d`) for sigmas drawn on the host, made on the device without the host
waiting.

A MONAI `GaussianFilter` holds each sigma as a float32 parameter; moved to a GPU it is copied from pageable memory
(the host waits), and `gaussian_1d` reads it back (`float(sigma)`, for the kernel's length: the host waits again),
then makes the kernel in a dozen small ops. Here the sigmas (the same float32 numbers) go to the device in one copy
from pinned memory. On a CUDA device, MONAI's default "erf" kernels are made at once: one row per sigma over the
longest kernel's positions, each kernel the centred slice of its own length; the ops are `gaussian_1d`'s, element
by element, and on a CUDA device an element's value does not depend on where in the tensor it lies, so each slice
is the kernel MONAI makes. Other approximations, and the CPU (where a kernel's elements past its last vector are
computed apart), run MONAI's own `gaussian_1d` per sigma, handed a device tensor that knows its host value.
"""

from __future__ import annotations

from typing import Any

from loaders.tail.device import to_device

_KNOWN: Any = None


def known(value: Any, host: float) -> Any:
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


def kernels(sigmas: list[Any], truncated: float, approx: str, device: Any) -> list[Any]:
    """`gaussian_1d(s, truncated, approx)` on `device` for each sigma of a `GaussianFilter` given `sigmas`."""
    import torch
    from monai.networks.layers.convutils import gaussian_1d

    if not sigmas:
        return []
    host = torch.as_tensor([float(s) for s in sigmas], dtype=torch.float)  # GaussianFilter's float32 sigmas
    values = host.tolist()
    on_device = to_device(host, device)
    if approx.lower() == "erf" and on_device.is_cuda:
        return _erf_rows(on_device, [tail_of(v, truncated) for v in values], truncated)
    return [gaussian_1d(known(on_device[j], v), truncated=truncated, approx=approx) for j, v in enumerate(values)]


def _erf_rows(sigma: Any, tails: list[int], truncated: float) -> list[Any]:
    """The "erf" kernels at once: row j over the longest kernel's positions, its kernel the centred slice of its
    own half length `tails[j]` (`tail_of` its sigma's host number)."""
    import torch

    if truncated <= 0.0:
        raise ValueError(f"truncated must be positive, got {truncated}.")
    most = max(tails)
    x = torch.arange(-most, most + 1, dtype=torch.float, device=sigma.device)
    t = 0.70710678 / torch.abs(sigma.reshape(-1, 1))
    out = 0.5 * ((t * (x + 0.5)).erf() - (t * (x - 0.5)).erf())
    out = out.clamp(min=0)
    return [out[j, most - tail : most + tail + 1] for j, tail in enumerate(tails)]


def tail_of(sigma: float, truncated: float) -> int:
    """The half length of `gaussian_1d`'s kernel for a sigma's host number."""
    return int(max(sigma * truncated, 0.5) + 0.5)


def kernel(sigma: Any, tail: int, truncated: float) -> Any:
    """MONAI's "erf" `gaussian_1d` for `sigma` (a (1,) float32 tensor on its device) whose kernel's half length is
    `tail` (`tail_of` its host number), with no host read: on a CUDA device its ops element by element (a CUDA graph
    replays it for any sigma of that length); elsewhere MONAI's own, which reads the sigma."""
    from monai.networks.layers.convutils import gaussian_1d

    if not sigma.is_cuda:
        return gaussian_1d(sigma[0], truncated=truncated, approx="erf")
    return _erf_rows(sigma, [tail], truncated)[0]
