"""`RandCoarseDropoutd`'s holes filled where the batch is, the host not waiting for the GPU.

MONAI fills an item's holes on the host: the whole item is copied down to numpy and back up (two waits and two
full copies on a GPU), and a random fill (no `fill_value`) draws between the item's min and max. Here the holes
and the fill numbers are drawn by MONAI's own `randomize` and numpy's generator from the transform's own state, in
MONAI's order (each item's holes, then its fills key by key, before the next item's holes), and written into a copy
of the item where it is (numpy's float64 numbers rounded to the item's dtype, as numpy's assignment rounds them).
For float32 and float64 keys (`device.float_keys`); others go through MONAI's own transform.

A random fill is numpy's `uniform(lo, hi)`: `lo + (hi - lo) * u` per number, `u` the generator's next double.
Where that holds for this numpy (`uniform_is_affine`, confirmed once a process against numpy's own `uniform`; a
numpy built to fuse the multiply and add would differ in the last bit), `u` is drawn on the host (the same words,
`random_sample`) and the rest is computed on the item's device from its min and max there, in float64: nothing
is read back mid-tail, so the tail's kernels stay one graph in a feeder. numpy refuses a range that is not finite
(`OverflowError`); that check is a device flag, raised once the tail's work is done (`TailBatch.checks`).
Otherwise each key's min and max of every item come back in one read a batch and numpy draws the fills.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from loaders.tail.device import to_device

RANGE_ERROR = "Range exceeds valid bounds"  # numpy's words for a uniform range that is not finite


def filled(inner: Any, img: Any, span: tuple[Any, Any] | None, checks: list[Any] | None = None) -> Any:
    """MONAI's `RandCoarseDropout(img, randomize=False)` with its holes drawn (`span`: the item's min and max,
    for a random fill: floats read on the host, or 0-dim float64 tensors on the item's device, whose range
    check goes to `checks`)."""
    import torch

    if not inner._do_transform:
        return img
    fill: Any = span if inner.fill_value is None else inner.fill_value
    ranged = isinstance(fill, (tuple, list))
    if ranged:
        uniform = (
            _on_device(inner, fill, img, checks) if isinstance(fill[0], torch.Tensor) else _on_host(inner, fill, img)
        )
    return holes_filled(inner, img, uniform if ranged else None)


def holes_filled(inner: Any, img: Any, uniform: Callable[[tuple[int, ...]], Any] | None) -> Any:
    """MONAI's `CoarseDropout` of one item with its holes drawn (`inner.hole_coords`): filled with `uniform(size)`
    (a random fill, as device numbers), or with `inner.fill_value` where `uniform` is None."""
    import torch

    if inner.dropout_holes:
        out = img.clone()
        for h in inner.hole_coords:
            out[h] = uniform(tuple(out[h].shape)) if uniform is not None else inner.fill_value
        return out
    out = uniform(tuple(img.shape)).to(img.dtype) if uniform is not None else torch.full_like(img, inner.fill_value)
    for h in inner.hole_coords:
        out[h] = img[h]
    return out


def _on_host(inner: Any, fill: Any, like: Any) -> Any:
    def uniform(size: tuple[int, ...]) -> Any:
        return _up(inner.R.uniform(fill[0], fill[1], size=size), like)

    return uniform


def _on_device(inner: Any, fill: Any, like: Any, checks: list[Any] | None) -> Any:
    import torch

    lo, hi = fill
    width = hi - lo
    checked: list[bool] = []  # the range's check added once, where numpy's first uniform would make it

    def uniform(size: tuple[int, ...]) -> Any:
        if checks is not None and not checked:
            checks.append((torch.isfinite(width), OverflowError(RANGE_ERROR)))
            checked.append(True)
        return _up(inner.R.random_sample(size), like).mul(width).add_(lo)

    return uniform


def _up(values: np.ndarray, like: Any) -> Any:
    import torch

    return to_device(torch.from_numpy(np.ascontiguousarray(values)), like.device)


@functools.cache
def uniform_is_affine() -> bool:
    """Whether numpy's `uniform(lo, hi, size)` is `lo + (hi - lo) * random_sample(size)`, number for number, with
    the multiply and the add rounded apart as torch's float64 ops round them (and the generator left alike)."""
    import torch

    spans = [(-1024.0, 3071.0), (0.0, 1.0), (-0.3, 0.7), (float(np.float32(-57.123)), float(np.float32(1e4 / 3))),
             (1e-30, 3e38), (-3.4e38, 3.4e38), (5.0, -2.5)]  # fmt: skip
    for lo, hi in spans:
        numpys, ours = np.random.RandomState(11), np.random.RandomState(11)
        want = numpys.uniform(lo, hi, size=4096)
        low, high = torch.tensor(lo, dtype=torch.float64), torch.tensor(hi, dtype=torch.float64)
        got = torch.from_numpy(ours.random_sample(4096)).mul(high - low).add_(low).numpy()
        if not np.array_equal(want, got) or numpys.random_sample() != ours.random_sample():
            return False
    return True
