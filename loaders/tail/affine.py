"""Batched RandAffined: each item's matrix drawn and built by MONAI, one grid_sample for the batch (`sample`,
which the batched Rand2DElasticd uses too).

MONAI's conventions, kept: the identity grid is centred voxel coordinates (`create_grid`), the item's
matrix (float32, as `AffineGrid` casts it) maps output to input voxels, rows are reversed into grid_sample's
(x, y, z) order and scaled by 2 / max(2, size) (`norm_coords`, align_corners=False), the resampling runs in
the resampler's dtype (float64 by default) and the output is float32, also for items that were not resampled.
Only the torch grid_sample modes (bilinear/nearest/bicubic; zeros/border/reflection) are batched.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import numpy as np

from loaders.tail.device import to_device
from loaders.tail.graphs import host_read
from loaders.tail.plans import Drawn, MatrixPlan
from loaders.tail.products import Products, at_once, identity, same_products, shown
from loaders.tail.tailbatch import TailBatch, gather, keys_of


def _modes(t: Any, keys: list[Hashable]) -> list[tuple[Any, Any]] | None:
    """grid_sample's (mode, padding_mode) for each key, or None where MONAI would not use grid_sample."""
    from monai.config import USE_COMPILED
    from monai.transforms.utils import resolves_modes
    from monai.utils import TransformBackends

    out = []
    for _key, mode, padding in t.key_iterator({k: None for k in keys}, t.mode, t.padding_mode):
        backend, interp, pad, _ = resolves_modes(mode, padding, backend=None, use_compiled=USE_COMPILED)
        if USE_COMPILED or backend != TransformBackends.TORCH:
            return None
        out.append((interp, pad))
    return out


def _item_matrix(t: Any, sp_size: tuple[int, ...]) -> Any:
    """The matrix MONAI's AffineGrid builds from the parameters just drawn (float32, as it casts it)."""
    import torch

    grid = t.rand_affine.rand_affine_grid
    # RandAffined calls its grid with the default randomize=True, so MONAI draws the parameters a second time
    # here; lazy=True builds and stores the matrix only, not the grid
    grid(sp_size, randomize=True, lazy=True)
    return torch.as_tensor(grid.get_transformation_matrix()).to(torch.float32)


def _grids(
    t: Any, mats: Any, sp_size: tuple[int, ...], in_size: tuple[int, ...], device: Any, where: Any = None,
    stacked: bool = False,
) -> Any:  # fmt: skip
    """Normalised sampling grids (m, *sp_size, nd) for grid_sample, one matrix per item.

    Each item's grid is MONAI's `AffineGrid`'s: the matrix times MONAI's identity grid, made where MONAI makes it
    (`_monais`) or at `where`: an item at a time, or all at once where `stacked` (a product of two or more, which
    `_made_where` found to give the host's numbers there). `where`: the replayed plan's device, where it is
    captured (not shown exact there: `MatrixPlan.exact_on_cuda`)."""
    import torch

    monais = _monais(t)
    where = monais if where is None else torch.device(where)
    cached = t.rand_affine._cached_grid
    grid = cached if cached is not None and cached.device == where else identity(sp_size, where)
    flat = torch.as_tensor(grid).to(dtype=torch.float32)
    flat = flat.view((flat.shape[0], -1))
    nd = len(sp_size)
    mats = to_device(mats, where)
    coords = at_once(mats, flat) if stacked else _products(mats, flat, device)
    return _normalised(t, coords[:, :nd], sp_size, in_size, device)


def _normalised(t: Any, coords: Any, sp_size: tuple[int, ...], in_size: tuple[int, ...], device: Any) -> Any:
    """Grids for grid_sample (m, *sp_size, nd) from the products' first nd rows (m, nd, V) on `device`: reversed,
    in the resampler's dtype, scaled to normalised coordinates, as MONAI's `Resample` makes them."""
    import torch

    nd = len(sp_size)
    coords = coords.flip(1)  # reversed: grid_sample wants (x, y, z) = (W, H, D)
    coords = coords.to(_resample_dtype(t))
    scale = to_device(torch.tensor([2.0 / max(2, d) for d in reversed(in_size)], dtype=coords.dtype), device)
    coords = coords * scale.view(1, nd, 1)
    return coords.movedim(1, -1).reshape(coords.shape[0], *sp_size, nd)


def _monais(t: Any) -> Any:
    """Where MONAI makes RandAffined's grids: its cached grid's device, the transform's own, else the host."""
    import torch

    cached = t.rand_affine._cached_grid
    return cached.device if cached is not None else torch.device(t.rand_affine.rand_affine_grid.device or "cpu")


def _made_where(t: Any, tb: TailBatch, sp_size: tuple[int, ...], device: Any, m: int) -> tuple[Any, bool]:
    """(where m items' grids are made, whether at once): where MONAI makes them on the host and the batch is on a
    CUDA device, there at once if a product of max(m, 2) probe matrices there gives the host's numbers bit for bit
    (`loaders.tail.products.same_products`), else on the host an item at a time; elsewhere where MONAI makes them,
    an item at a time."""
    import torch

    monais, device = _monais(t), torch.device(device)
    if monais.type != "cpu" or device.type != "cuda":
        return monais, False
    same = shown(sp_size, device, max(m, 2))
    if same is None:  # checked once: its read of the GPU closes a captured segment
        with host_read(tb):
            same = same_products(_host_identity(t, sp_size), sp_size, device, max(m, 2))
    return (device, True) if same else (monais, False)


def _host_identity(t: Any, sp_size: tuple[int, ...]) -> Any:
    """The identity grid MONAI multiplies on the host: the transform's cached one, else `create_grid`'s."""
    import torch

    cached = t.rand_affine._cached_grid
    return cached if cached is not None and cached.device.type == "cpu" else identity(sp_size, torch.device("cpu"))


def _products(mats: Any, flat: Any, device: Any) -> Any:
    """Each matrix times the identity grid, MONAI's `affine @ grid_.view(...)` an item at a time where the grid
    is, stacked on `device`. From the host: each product written straight into page-locked memory (one block an
    item: the same size every batch, so the caching host allocator reuses them), on the draw threads at once
    (torch's product runs without the interpreter lock), then copied up without the host waiting."""
    import torch

    from loaders.tail.ahead import drawers

    device = torch.device(device)
    if flat.device == device or device.type != "cuda":
        return torch.stack([m @ flat for m in mats]).to(device)
    staged = [torch.empty((mats.shape[1], flat.shape[1]), dtype=flat.dtype, pin_memory=True) for _ in mats]
    list(drawers().map(lambda i: torch.mm(mats[i], flat, out=staged[i]), range(len(staged))))
    return torch.stack([to_device(s, device) for s in staged])


def _resample_dtype(t: Any) -> Any:
    """The dtype MONAI's Resample converts the image and grid to (float64 unless set)."""
    import torch
    from monai.utils import get_equivalent_dtype

    dtype = t.rand_affine.resampler.dtype
    return get_equivalent_dtype(dtype, torch.Tensor) if dtype is not None else torch.float64


def sample(x: Any, grids: Any, interp: Any, pad: Any, align: Any, dtype: Any) -> Any:
    """MONAI's `Resample` (torch backend) over a batch: `x` (n, C, *spatial) in the resampler's dtype, sampled on
    `grids` (n, *out, nd) by one grid_sample, float32 out."""
    import torch
    from monai.utils import TraceKeys

    corners = None if align == TraceKeys.NONE else align
    out = torch.nn.functional.grid_sample(x.to(dtype), grids, mode=interp, padding_mode=pad, align_corners=corners)
    return out.to(torch.float32)


def rand_affine(t: Any, batch: TailBatch) -> bool:
    """RandAffined: per-item draws and matrices from MONAI, then one grid_sample per key over the batch."""
    import torch
    from monai.utils import fall_back_tuple

    keys = keys_of(t, batch)
    if not keys:
        return True  # MONAI draws nothing when none of its keys is present
    shapes = {tuple(batch.data[k].shape[2:]) for k in keys if batch.is_batched(k)}
    modes = _modes(t, keys)
    resampler = t.rand_affine.resampler
    if len(shapes) != 1 or any(not batch.is_batched(k) for k in keys) or modes is None:
        return False
    if not resampler.norm_coords:
        return False
    in_size = shapes.pop()
    sp_size = tuple(int(s) for s in fall_back_tuple(t.rand_affine.spatial_size, in_size))
    eye = torch.eye(len(sp_size) + 1, dtype=torch.float32)
    chosen, mats = [], []
    for i in range(batch.n):
        t.randomize(None)
        t.rand_affine.randomize()
        if t._do_transform:
            chosen.append(i)
            mats.append(_item_matrix(t, sp_size))
        elif sp_size != in_size:  # only the output size changes: the identity grid resamples
            chosen.append(i)
            mats.append(eye)
        if chosen and chosen[-1] == i:
            # MONAI then resamples each key through RandAffine.__call__(..., randomize=True, grid): the grid
            # is given, but the call draws once more per key, which moves the stream for the next item
            for _ in keys:
                t.rand_affine.randomize()
    if not chosen:
        for k in keys:
            batch.data[k] = batch.data[k].to(torch.float32)
        return True
    device = batch.data[keys[0]].device
    where, stacked = _made_where(t, batch, sp_size, device, len(chosen))
    grids = _grids(t, torch.stack(mats), sp_size, in_size, device, where, stacked)
    dtype = _resample_dtype(t)
    for k, (interp, pad) in zip(keys, modes):
        x = batch.data[k]
        src = gather(x, [x[i] for i in chosen]) if len(chosen) < batch.n else x
        out = sample(src, grids, interp, pad, resampler.align_corners, dtype)
        if len(chosen) < batch.n:  # the others keep their values, as float32 (MONAI converts them too)
            where = {i: j for j, i in enumerate(chosen)}
            out = gather(out, [out[where[i]] if i in where else x[i].to(torch.float32) for i in range(batch.n)])
        batch.data[k] = out
    return True


def plan_affine(t: Any, keys: list[Hashable], like: Any) -> Any:
    """RandAffined's plan (`loaders.tail.plans`) where it resamples to the item's own size by grid_sample on
    normalised coordinates: each item's matrix drawn (the identity where it does not fire), every item resampled
    and the fired ones kept (the others as float32, as MONAI converts them)."""
    from monai.utils import fall_back_tuple

    shapes = {tuple(like[k].shape[2:]) for k in keys}
    modes = _modes(t, keys)
    if len(shapes) != 1 or modes is None or not t.rand_affine.resampler.norm_coords:
        return None
    in_size = shapes.pop()
    sp_size = tuple(int(s) for s in fall_back_tuple(t.rand_affine.spatial_size, in_size))
    return None if sp_size != in_size else _AffinePlan(t, keys, modes, sp_size)


class _AffinePlan(MatrixPlan):
    """Each item's matrix and, for the items it fires on, its product with the identity grid as MONAI makes it on
    the host (`host_products`: the draws then carry the grids' numbers, described, `loaders.tail.products`, so the
    work is MONAI's on any device; else the products are made on the batch's device an item at a time, which on an
    H200 came out up to 5.4e-7 from the host's)."""

    def __init__(self, t: Any, keys: list[Hashable], modes: list[tuple[Any, Any]], size: tuple[int, ...]) -> None:
        super().__init__(t, keys, size)
        self.modes = modes
        self.host_products = _monais(t).type == "cpu"
        self.exact_on_cuda = self.host_products

    def fire(self) -> Any:
        """`rand_affine`'s draws for one item, in its order: MONAI's matrix where it fires (and the draws its calls
        per key make after)."""
        t = self.t
        t.randomize(None)
        t.rand_affine.randomize()
        if not t._do_transform:
            return None
        matrix = _item_matrix(t, self.size).numpy()
        for _ in self.keys:
            t.rand_affine.randomize()
        return matrix

    def draw(self, n: int) -> Drawn:
        from loaders.tail.plans import fired_count

        drawn = super().draw(n)
        if not self.host_products:
            return drawn
        mats, fired = drawn.values["mats"], drawn.values["fired"]
        # described, made where the work runs (`Products`): where it runs on the fired rows alone (`on_fired`),
        # their products alone (one row of zeros where none fired); else a row for every item, zeros where it did
        # not fire
        if fired_count(drawn.kind) is not None:
            chosen = mats[fired] if fired.any() else np.zeros_like(mats[:1])
        else:
            chosen = np.where(fired[:, None, None], mats, np.float32(0))
        return Drawn(drawn.kind, {**drawn.values, "coords": Products(np.ascontiguousarray(chosen), self.size)})

    def values_like(self, n: int) -> dict[str, Any]:
        from loaders.tail.plans import _meta

        like = super().values_like(n)
        if self.host_products:
            like["coords"] = _meta((n, len(self.size), int(np.prod(self.size))), "float32")
        return like

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        import torch

        first = data[self.keys[0]]
        if first.device.type == "meta":
            return {k: torch.empty(data[k].shape, dtype=torch.float32, device="meta") for k in self.keys}
        from loaders.tail.plans import fired_count, on_fired, rows_of

        dtype, align = _resample_dtype(self.t), self.t.rand_affine.resampler.align_corners
        made: dict[int, Any] = {}  # the grids of the rows resampled, made once for every key
        alone = fired_count(kind) is not None  # the products drawn for the fired rows alone (`draw`)

        def grids(rows: Any) -> Any:
            if len(rows) not in made:
                if self.host_products:  # the host's products, drawn with the matrices (the fired rows' alone)
                    coords = values["coords"] if alone else rows_of(values["coords"], rows)
                    made[len(rows)] = _normalised(self.t, coords, self.size, self.size, first.device)
                else:  # each item's grid by a matmul of its own on the device
                    mats = rows_of(values["mats"], rows)
                    made[len(rows)] = torch.cat([_grids(self.t, mats[j : j + 1], self.size, self.size, first.device,
                                                        first.device) for j in range(len(rows))])  # fmt: skip
            return made[len(rows)]

        out = {}
        for k, (interp, pad) in zip(self.keys, self.modes):
            resample = lambda v, rows, i=interp, p=pad: sample(v, grids(rows), i, p, align, dtype)  # noqa: E731
            out[k] = on_fired(data[k], kind, values["fired"], resample, lambda v: v.to(torch.float32))
        return out
