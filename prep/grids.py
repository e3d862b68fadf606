"""One sampling grid per item geometry: an image and its label resampled alike share the grid.

MONAI's `Spacingd`/`Orientationd`-style resampling (`monai.networks.layers.AffineTransform`) calls
`torch.nn.functional.affine_grid` once per key, and for an image and its label (same affine, same shape) the
calls are identical: same `theta`, same size, same `align_corners`. Making that grid is most of a resampling's
CPU on one torch thread (docs/benchmarks.md, Preparation).

Inside `shared_grids()`, on this thread only, a call whose arguments equal the previous call's (theta's exact
values, dtype, shape and device; size; align_corners) gets the same grid tensor back, so the second key's
resampling reuses the first key's grid: `affine_grid` is a pure function of those arguments, so the values are
the ones a fresh call computes. The grid is handed out again only if nobody changed it in place since (torch's
version counter), and only grids without autograd history. Other threads, and every call outside the block,
reach torch's own function.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

_LOCAL = threading.local()  # .on (inside shared_grids), .last: (key, grid, grid._version)
_INSTALLED: list[Any] = []
_INSTALL_LOCK = threading.Lock()  # threads of one worker start items at once
MIN_POINTS = 32**3  # smaller grids cost less than the key


def _key(theta: Any, size: Any, align_corners: Any) -> tuple | None:
    import torch

    if not isinstance(theta, torch.Tensor) or theta.requires_grad or theta.device.type != "cpu":
        return None
    points = 1
    for n in list(size)[2:]:
        points *= int(n)
    if points < MIN_POINTS:
        return None
    try:
        values = theta.detach().contiguous().numpy().tobytes()
    except (TypeError, RuntimeError):  # a dtype numpy lacks
        return None
    return theta.dtype, tuple(theta.shape), values, tuple(int(n) for n in size), align_corners


def _shared(original: Any) -> Any:
    def affine_grid(theta: Any, size: Any, align_corners: Any = None) -> Any:
        if not getattr(_LOCAL, "on", False):
            return original(theta, size, align_corners)
        key = _key(theta, size, align_corners)
        last = getattr(_LOCAL, "last", None)
        if key is not None and last is not None and last[0] == key and last[1]._version == last[2]:
            return last[1]
        grid = original(theta, size, align_corners)
        _LOCAL.last = (key, grid, grid._version) if key is not None and not grid.requires_grad else None
        return grid

    affine_grid.__wrapped__ = original  # type: ignore[attr-defined]
    return affine_grid


def _install() -> None:
    """Put the sharing function in front of torch's `affine_grid` (once per process)."""
    with _INSTALL_LOCK:
        if _INSTALLED:
            return
        import torch.nn.functional as F

        F.affine_grid = _shared(F.affine_grid)
        _INSTALLED.append(True)


@contextmanager
def shared_grids() -> Iterator[None]:
    """Within the block, on this thread, repeated `affine_grid` calls with equal arguments share one grid."""
    _install()
    _LOCAL.on, _LOCAL.last = True, None
    try:
        yield
    finally:
        _LOCAL.on, _LOCAL.last = False, None
