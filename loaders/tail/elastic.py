"""`Rand3DElasticd`: MONAI's own transform on each item, its draws made ahead on a thread; `Rand2DElasticd`: MONAI's
own transform on each item makes its draws and grid, one grid_sample resamples the batch.

Its cost is its draws: per item a dense field of uniform offsets, three numbers per voxel of the crop (2.65 M for
96^3: 28 ms of numpy on a GPU box's core, three quarters of the loader's time on `seg-elastic`), drawn whether or
not the item is deformed. The smoothing, the grid and the resampling are a few kernels on the item's device.
So the batch's draws are made by MONAI's own `randomize`, item by item in batch order, on the draw-ahead thread
(`loaders.tail.ahead`: exact, or drawn inline), and MONAI's own dict transform then runs on each item with those
draws put back in place of its `randomize` calls: the same code, the same numbers, the draws off the tail's path.

The inner `RandAffineGrid` draws twice per item (in the elastic's `randomize` and again when it makes the grid),
so with any affine range given the draws cannot be taken out of order: such a transform runs per item as before.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from loaders.tail.ahead import _Like, ahead
from loaders.tail.batched import TailBatch
from loaders.tail.sparse import Apply, assemble, ready

_RANGES = ("rotate_range", "shear_range", "translate_range", "scale_range")
Drawn = tuple[bool, bool, Any, float, float]  # the dict's and the inner's _do_transform, offsets, magnitude, sigma


def _draws(t: Any, inner: Any, n: int, like: Any) -> list[Drawn]:
    """n items' draws as MONAI's dict transform makes them, in order (`like.shape`: the grid's size)."""
    out = []
    for _ in range(n):
        t.randomize(None)
        inner.randomize(like.shape)
        out.append((bool(t._do_transform), bool(inner._do_transform), getattr(inner, "rand_offset", None),
                    inner.magnitude, inner.sigma))  # fmt: skip
    return out


def rand_3d_elastic(t: Any, batch: TailBatch) -> bool:
    """Rand3DElasticd: the draws ahead, then MONAI's own dict transform per item with them."""
    from monai.utils import fall_back_tuple

    keys = ready(t, batch)
    inner = t.rand_3d_elastic
    if not keys or any(f is not None for r in _RANGES for f in getattr(inner.rand_affine_grid, r, ())):
        return False
    size = tuple(fall_back_tuple(inner.spatial_size, tuple(batch.data[keys[0]].shape[2:])))
    early = ahead(t, inner, "rand_offset", _draws)
    drawn = _draws(t, inner, batch.n, _Like(size)) if early is None else early.take(batch.n, size)
    outs: dict[int, dict[Hashable, Any]] = {}

    def one(i: int) -> Apply:
        def apply(k: Hashable, x: Any) -> Any:
            if i not in outs:
                outs[i] = _with_draws(t, inner, drawn[i], batch.item(i))
            return outs[i][k]

        return apply

    assemble(batch, keys, {i: one(i) for i in range(batch.n)}, lambda x: x)
    return True


def _with_draws(t: Any, inner: Any, drawn: Drawn, item: dict[Hashable, Any]) -> dict[Hashable, Any]:
    """MONAI's dict transform on `item`, its two `randomize` calls giving back `drawn` instead of drawing."""
    do, inner_do, offset, magnitude, sigma = drawn

    def dict_randomize(_: Any = None) -> None:
        t._do_transform = do

    def inner_randomize(_: Any = None) -> None:
        inner._do_transform = inner_do
        inner.rand_offset, inner.magnitude, inner.sigma = offset, magnitude, sigma
        inner.rand_affine_grid.randomize()  # no range given: draws nothing, sets MONAI's empty parameters

    t.randomize, inner.randomize = dict_randomize, inner_randomize
    try:
        return dict(t(item))
    finally:
        del t.randomize, inner.randomize


class _Noting:
    """Stands in for Rand2DElastic's `Resample` while MONAI's dict transform runs on one item: notes the grid the
    item is resampled on and gives the image back as it is."""

    def __init__(self, device: Any) -> None:
        self.device = device  # MONAI's set_device sets it on the resampler it finds
        self.grid: Any = None

    def __call__(self, img: Any, grid: Any = None, **_: Any) -> Any:
        self.grid = grid
        return img


def rand_2d_elastic(t: Any, batch: TailBatch) -> bool:
    """Rand2DElasticd: MONAI's own dict transform on each item, in batch order, draws the item's numbers and makes
    its grid (an identity grid where it does not fire: MONAI resamples every item); then each key of the batch is
    resampled at once, as MONAI's `Resample` does item by item (torch backend, normalised coordinates)."""
    import torch
    from monai.utils import get_equivalent_dtype

    from loaders.tail.affine import _modes, sample

    keys = ready(t, batch)
    if keys is None:
        return False
    if not keys:
        return True  # MONAI draws nothing when none of its keys is present
    inner = t.rand_2d_elastic
    resampler = inner.resampler
    modes = _modes(t, keys)
    if modes is None or not resampler.norm_coords or resampler.dtype is None:
        return False  # the per-key dtype, or MONAI's own coordinates: per item
    noting = _Noting(resampler.device)
    grids = []
    inner.resampler = noting
    try:
        for i in range(batch.n):
            t(batch.item(i))
            grids.append(torch.as_tensor(noting.grid).as_subclass(torch.Tensor))
    finally:
        inner.resampler = resampler
        resampler.device = noting.device
    x = batch.data[keys[0]]
    dtype = get_equivalent_dtype(resampler.dtype, torch.Tensor)
    size = tuple(x.shape[2:])
    rows = list(range(len(size) - 1, -1, -1))  # grid_sample's (x, y) order
    grid = torch.stack([g[rows].movedim(0, -1).to(device=x.device, dtype=dtype) for g in grids])
    for axis, dim in enumerate(reversed(size)):
        grid[..., axis] *= 2.0 / max(2, dim)
    for k, (interp, pad) in zip(keys, modes):
        batch.data[k] = sample(batch.data[k], grid, interp, pad, resampler.align_corners, dtype)
    return True
