"""`Rand3DElasticd`: MONAI's own transform on each item, its draws made ahead on a thread; `Rand2DElasticd`: MONAI's
own transform on each item makes its draws and grid, one grid_sample resamples the batch.

Its cost is its draws: per item a dense field of uniform offsets, three numbers per voxel of the crop (2.65 M for
96^3: 28 ms of numpy on a GPU box's core, three quarters of the loader's time on `seg-elastic`), drawn whether or
not the item is deformed. The smoothing, the grid and the resampling are a few kernels on the item's device. So the
batch's draws are made by MONAI's own `randomize` ahead of the tail (`loaders.tail.ahead`: exact, or drawn inline).
Where the affine grid has no range, each item's grid is then made as MONAI's dict transform makes it, op for op,
with no host wait (`_grids_here`: MONAI copies the smoothing's sigma and the affine between host and device and
reads the sigma back); otherwise MONAI's own dict transform runs on each item with the draws put back in place of
its `randomize` calls: the same code, the same numbers, the draws off the tail's path. One stream drawing every item
in turn would bound `seg-elastic` at 0.42 of its ceiling, and moving it past each item's words (a fixed count of
uniform numbers, confirmed once per shape against MONAI's own draw) at 0.3: so each item's start is jumped to
(`loaders.tail.mtjump`, 2-3 ms whatever the count) and the items draw at once on the draw threads; an item whose
draws end anywhere but the next item's start raises. Where the dict transform and the inner one draw from two
streams, a batch's starts come at once from a helper process (`loaders.tail.stream`: no interpreter lock held).

The inner `RandAffineGrid` draws twice per item (in the elastic's `randomize` and again when it makes the grid),
from its own stream: drawing ahead sends its draws aside, and MONAI's transform on each item makes both from the
real grid, in MONAI's order. Where the grid shares a stream with the offsets (one `RandomState` given to both), the
two interleave item by item: such a transform runs per item.
"""

from __future__ import annotations

import copy
from collections.abc import Hashable
from typing import Any

import numpy as np

from loaders.tail import stream, uniforms
from loaders.tail.ahead import _Like, ahead, drawers, from_state, resolved, same_state, skip, skippable
from loaders.tail.plans import Plan
from loaders.tail.sparse import Apply, assemble, ready
from loaders.tail.tailbatch import TailBatch

_RANGES = ("rotate_range", "shear_range", "translate_range", "scale_range")
Drawn = tuple[bool, bool, Any, float, float]  # the dict's and the inner's _do_transform, offsets, magnitude, sigma


def _draws(t: Any, inner: Any, n: int, like: Any) -> list[Any]:
    """n items' draws as MONAI's dict transform makes them, in order (`like.shape`: the grid's size). Where the
    inner transform's words can be skipped over, each item draws on the draw threads (a Future of its draw)."""
    words = _words(inner, tuple(like.shape))
    if words is not None and t.R is not inner.R:  # two streams: the dict's probs, then the inner's items at once
        dos = []
        for _ in range(n):
            t.randomize(None)
            dos.append(bool(t._do_transform))
        begins = stream.starts(inner.R, words, n)  # each item's start, moved past in the helper process
        ends = [*begins[1:], inner.R.get_state()]
        copies = [_copy(inner) for _ in range(n)]  # copied here: the real one may be running MONAI's transform
        return [drawers().submit(_draw_one, d, c, b, like.shape, e) for d, c, b, e in zip(dos, copies, begins, ends)]
    out: list[Any] = []
    for _ in range(n):
        t.randomize(None)
        if words is None:
            one = _copy(inner)  # draws from the inner's own stream
            one.randomize(like.shape)
            out.append(_taken(bool(t._do_transform), one))
            continue
        start = inner.R.get_state()
        stream.advance(inner.R, words)  # jumped: the words are many
        one = _copy(inner)  # copied here: the real one may be running MONAI's transform meanwhile
        out.append(drawers().submit(_draw_one, bool(t._do_transform), one, start, like.shape, inner.R.get_state()))
    return out


# where the affine grid draws while the offsets are drawn ahead: MONAI's transform draws those numbers again, from
# the real grid's own stream, when it runs on the item (`_with_draws`), in MONAI's order
_ASIDE = np.random.RandomState(0)


def _copy(inner: Any) -> Any:
    """A copy of the inner transform whose `randomize` sets attributes of its own only and draws from the inner's
    stream (or the one set on the copy), its affine grid's draws going aside."""
    one = copy.copy(inner)
    one.rand_affine_grid = copy.copy(inner.rand_affine_grid)
    one.rand_affine_grid.R = _ASIDE
    return one


def _taken(do: bool, inner: Any) -> Drawn:
    return do, bool(inner._do_transform), getattr(inner, "rand_offset", None), inner.magnitude, inner.sigma


def _draw_one(do: bool, one: Any, start: Any, shape: tuple[int, ...], end: Any) -> Drawn:
    """One item's draws by MONAI's own `randomize`, from the state its words start at; its offsets described
    (`loaders.tail.uniforms`: made on the device that uses them) where this process defers them."""
    import math

    if uniforms.deferring() and uniforms.Deferring.usable(end, _AFTER):
        one.R = uniforms.Deferring(start, end, 3 * math.prod(shape), _AFTER)
    else:
        one.R = from_state(start)
    one.randomize(shape)
    if not same_state(one.R.get_state(), end):
        raise RuntimeError(f"{type(one).__name__}: an item's draws took other than the words skipped for them")
    one.rand_offset = _pinned(getattr(one, "rand_offset", None))
    return _taken(do, one)


def _pinned(offset: Any) -> Any:
    """Drawn offsets copied into pinned memory here on the draw thread where this process uses CUDA (numpy's
    numbers as drawn): the tail then only queues their copy to the device."""
    import torch

    if not isinstance(offset, np.ndarray) or not torch.cuda.is_initialized():
        return offset
    out = torch.empty(offset.shape, dtype=torch.from_numpy(offset[:0]).dtype, pin_memory=True)
    np.copyto(out.numpy(), offset)
    return out


_WORDS: dict[tuple[type, tuple[int, ...]], int | None] = {}
_AFTER = 4  # the words drawn after the offsets: the magnitude's and the sigma's


def _words(inner: Any, shape: tuple[int, ...]) -> int | None:
    """The generator words one item's `randomize` takes (prob, 3 offsets a voxel, magnitude, sigma: two words
    each), where that count does not depend on what is drawn and MONAI's own draw confirms it; else None."""
    import math

    if float(inner.prob) < 1.0 or not skippable(inner.R):
        return None
    key = (type(inner), shape)
    if key not in _WORDS:
        words = 2 * (3 + 3 * math.prod(shape))
        start = inner.R.get_state()
        one = _copy(inner)
        one.R = np.random.RandomState()
        one.R.set_state(start)
        one.randomize(shape)
        probe = np.random.RandomState()
        probe.set_state(start)
        skip(probe, words)
        _WORDS[key] = words if same_state(one.R.get_state(), probe.get_state()) else None
    return _WORDS[key]


def rand_3d_elastic(t: Any, batch: TailBatch) -> bool:
    """Rand3DElasticd: the draws ahead, then MONAI's own dict transform per item with them, its grids resampled
    at once per key where MONAI's resampler is grid_sample on normalised coordinates (else per item)."""
    from monai.utils import fall_back_tuple

    keys = ready(t, batch)
    inner = t.rand_3d_elastic
    grid = inner.rand_affine_grid
    ranged = any(f is not None for r in _RANGES for f in getattr(grid, r, ()))
    if not keys or (ranged and (grid.R is inner.R or grid.R is t.R)):
        return False  # one stream for the affine grid and the other draws: they interleave item by item
    size = tuple(fall_back_tuple(inner.spatial_size, tuple(batch.data[keys[0]].shape[2:])))
    uniforms.use_on(batch.data[keys[0]].device)  # the offsets made there once its kernel is checked
    early = ahead(t, inner, "rand_offset", _draws)
    drawn = _draws(t, inner, batch.n, _Like(size)) if early is None else early.take(batch.n, size)
    modes = _modes_at_once(t, inner, keys)
    if modes is not None and not ranged:  # the grids made here, as MONAI's dict transform makes them
        grids = _grids_here(inner, [resolved(d) for d in drawn], size, batch.data[keys[0]].device)
        _resample(inner, batch, keys, modes, grids)
        return True
    if modes is not None:
        run = lambda i: _with_draws(t, inner, resolved(drawn[i]), batch.item(i))  # noqa: E731
        _resample_at_once(inner, batch, keys, modes, run)
        return True
    outs: dict[int, dict[Hashable, Any]] = {}

    def one(i: int) -> Apply:
        def apply(k: Hashable, x: Any) -> Any:
            if i not in outs:
                outs[i] = _with_draws(t, inner, resolved(drawn[i]), batch.item(i))
            return outs[i][k]

        return apply

    assemble(batch, keys, {i: one(i) for i in range(batch.n)}, lambda x: x)
    return True


def _with_draws(t: Any, inner: Any, drawn: Drawn, item: dict[Hashable, Any]) -> dict[Hashable, Any]:
    """MONAI's dict transform on `item`, its two `randomize` calls giving back `drawn` instead of drawing. Where
    MONAI would copy the item's offsets to a GPU (`torch.as_tensor(offsets, device)`: from pageable memory, a copy
    that waits for the work queued before it), they are given to it there already, copied from pinned memory
    (`torch.as_tensor` of a tensor on its device is that tensor: the same numbers, no copy)."""
    do, inner_do, offset, magnitude, sigma = drawn
    if do:
        offset = _where_used(t, inner, item, offset)
    elif not isinstance(offset, np.ndarray) and hasattr(offset, "numpy"):
        offset = offset.numpy()  # pinned, not used: as MONAI would have drawn it

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


def _where_used(t: Any, inner: Any, item: dict[Hashable, Any], offset: Any) -> Any:
    """The drawn offsets on the CUDA device MONAI's transform makes the item's grid on, else as they are."""
    first = t.first_key(item)
    return _offset_on(offset, inner.device if inner.device is not None else getattr(item.get(first), "device", None))


def _offset_on(offset: Any, device: Any) -> Any:
    """Offsets drawn (numpy's, or pinned by the draw thread) where MONAI's transform uses them: copied from pinned
    memory to a CUDA device, else as numpy's array."""
    import torch

    from loaders.tail.device import to_device
    from loaders.tail.graphs import keep

    on_cuda = device is not None and torch.device(device).type == "cuda"
    if isinstance(offset, uniforms.Uniforms):  # described: made on the device (numpy's draw off it)
        return uniforms.on_device([offset], device)[0] if on_cuda else np.asarray(offset)
    if isinstance(offset, torch.Tensor):  # pinned by the draw thread
        if not on_cuda:
            return offset.numpy()
        keep(offset)  # inside a captured segment, the copy runs when the segment does
        return offset.to(device, non_blocking=True)
    if not isinstance(offset, np.ndarray) or not on_cuda:
        return offset
    return to_device(torch.from_numpy(offset), device)


def _offsets_on(offsets: list[Any], device: Any) -> list[Any]:
    """`_offset_on` of each, the described ones made on a CUDA device by one launch."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        offsets = uniforms.on_device(offsets, device)
    return [_offset_on(o, device) for o in offsets]


class _Noting:
    """Stands in for an elastic transform's `Resample` while MONAI's dict transform runs on one item: notes the grid the
    item is resampled on and gives the image back as it is."""

    def __init__(self, device: Any) -> None:
        self.device = device  # MONAI's set_device sets it on the resampler it finds
        self.grid: Any = None

    def __call__(self, img: Any, grid: Any = None, **_: Any) -> Any:
        self.grid = grid
        return img


def rand_2d_elastic(t: Any, batch: TailBatch) -> bool:
    """Rand2DElasticd: MONAI's own dict transform on each item, in batch order, draws the item's numbers and makes
    its grid; then each key of the batch is resampled at once."""
    keys = ready(t, batch)
    if keys is None:
        return False
    if not keys:
        return True  # MONAI draws nothing when none of its keys is present
    inner = t.rand_2d_elastic
    modes = _modes_at_once(t, inner, keys)
    if modes is None:
        return False
    _resample_at_once(inner, batch, keys, modes, lambda i: t(batch.item(i)))
    return True


def _modes_at_once(t: Any, inner: Any, keys: list[Hashable]) -> list[tuple[Any, Any]] | None:
    """grid_sample's modes per key where the batch can be resampled at once (MONAI's torch backend, normalised
    coordinates, one dtype for every key), else None."""
    from loaders.tail.affine import _modes

    resampler = inner.resampler
    modes = _modes(t, keys)
    return None if modes is None or not resampler.norm_coords or resampler.dtype is None else modes


def _resample_at_once(
    inner: Any, batch: TailBatch, keys: list[Hashable], modes: list[tuple[Any, Any]], run: Any
) -> None:
    """`run(i)` (MONAI's dict transform on item i) for each item in batch order, its resampler noting the item's
    grid (an identity grid where it does not fire: MONAI resamples every item); then each key of the batch
    resampled at once on those grids (`_resample`)."""
    import torch

    resampler = inner.resampler
    noting = _Noting(resampler.device)
    grids = []
    inner.resampler = noting
    try:
        for i in range(batch.n):
            run(i)
            grids.append(torch.as_tensor(noting.grid).as_subclass(torch.Tensor))
    finally:
        inner.resampler = resampler
        resampler.device = noting.device
    _resample(inner, batch, keys, modes, grids)


def _resample(
    inner: Any, batch: TailBatch, keys: list[Hashable], modes: list[tuple[Any, Any]], grids: list[Any]
) -> None:
    batch.data.update(resampled(inner, batch.data, keys, modes, grids))


def resampled(
    inner: Any, data: dict[Hashable, Any], keys: list[Hashable], modes: list[tuple[Any, Any]], grids: list[Any]
) -> dict[Hashable, Any]:
    """Each key of the batch resampled at once on the items' grids, as MONAI's `Resample` does item by item
    (torch backend, normalised coordinates)."""
    import torch
    from monai.utils import get_equivalent_dtype

    from loaders.tail.affine import sample

    resampler = inner.resampler
    x = data[keys[0]]
    dtype = get_equivalent_dtype(resampler.dtype, torch.Tensor)
    size = tuple(x.shape[2:])
    nd = len(size)  # the grid's first rows, reversed: grid_sample's (x, y, z) order
    grid = torch.stack([g[:nd].flip(0).movedim(0, -1).to(device=x.device, dtype=dtype) for g in grids])
    for axis, dim in enumerate(reversed(size)):
        grid[..., axis] *= 2.0 / max(2, dim)
    return {
        k: sample(data[k], grid, interp, pad, resampler.align_corners, dtype) for k, (interp, pad) in zip(keys, modes)
    }


def _grids_here(inner: Any, drawn: list[Drawn], size: tuple[int, ...], first: Any) -> list[Any]:
    """Each item's grid as MONAI's `Rand3DElasticd` makes it where its affine grid has no range, with no host wait:
    MONAI's identity grid; where the item is deformed, its offsets smoothed by MONAI's `separable_filtering` with
    the kernels of its sigma (`loaders.tail.gauss`, truncated at 3 as MONAI's filter is), times its magnitude, added
    to the grid's first rows; then, in the affine grid's dtype, the identity affine applied as MONAI's `AffineGrid`
    applies it (the same matmul: the same numbers where a user's TF32 setting rounds them). MONAI moves the filter's
    sigma and the affine between host and device and reads the sigma back; here nothing is read back. `first`: the
    device of the transform's first key.
    """
    import torch
    from monai.networks.layers.simplelayers import separable_filtering
    from monai.transforms import AffineGrid
    from monai.transforms.utils import create_grid

    from loaders.tail import gauss

    device = inner.device
    if device is None:
        device = first
        inner.set_device(device)  # as MONAI's dict transform does, for this call and the next
    dtype: Any = AffineGrid(dtype=inner.rand_affine_grid.dtype).dtype  # what MONAI's affine grid computes in
    fired = [j for j, d in enumerate(drawn) if d[0]]
    smoothing = gauss.kernels([drawn[j][4] for j in fired], 3.0, "erf", device)
    offsets = dict(zip(fired, _offsets_on([drawn[j][2] for j in fired], device)))
    grids = []
    for j, (do, _, _, magnitude, _) in enumerate(drawn):
        grid: Any = create_grid(spatial_size=size, device=device, backend="torch")
        if do:
            k = smoothing[fired.index(j)]
            moved = torch.as_tensor(offsets[j], device=device).unsqueeze(0)
            grid[:3] += separable_filtering(x=moved, kernels=[k, k, k])[0] * magnitude
            grid = grid.to(dtype or grid.dtype)  # AffineGrid's dtype (float32 by default: the grid was float64)
            affine = torch.eye(len(size) + 1, device=device, dtype=grid.dtype)
            grid = (affine @ grid.view((grid.shape[0], -1))).view([-1, *grid.shape[1:]])
            inner.rand_affine_grid.affine = affine
        grids.append(grid)
    if drawn:  # what MONAI's last call leaves on its transform
        inner._do_transform = drawn[-1][1]
        inner.rand_offset, inner.magnitude, inner.sigma = drawn[-1][2:]
    return grids


def plan_3d(t: Any, keys: list[Hashable], like: Any) -> Any:
    """Rand3DElasticd's plan (`loaders.tail.plans`) where its affine grid has no range and every key is resampled
    by grid_sample on normalised coordinates: per item, its kernels' length (its sigma's) picks the graph."""
    import torch
    from monai.utils import fall_back_tuple

    inner = t.rand_3d_elastic
    grid = inner.rand_affine_grid
    if any(f is not None for r in _RANGES for f in getattr(grid, r, ())):
        return None
    if inner.device is not None and torch.device(inner.device).type != "cuda":
        return None  # MONAI makes the grid where it is told: the plan makes it where the batch is
    modes = _modes_at_once(t, inner, keys)
    shapes = {tuple(like[k].shape[2:]) for k in keys}
    if modes is None or len(shapes) != 1 or len(next(iter(shapes))) != 3:
        return None
    size = tuple(int(s) for s in fall_back_tuple(inner.spatial_size, next(iter(shapes))))
    if size != next(iter(shapes)):
        return None  # a grid of another size than the item's: MONAI resamples to it
    return _ElasticPlan(t, keys, modes, size)


class _ElasticPlan(Plan):
    """Rand3DElasticd split in two: each item's draws (made ahead on the draw threads, as `rand_3d_elastic` takes
    them) and, per item, its grid made as `_grids_here` makes it, then each key resampled as `_resample` does."""

    per_item = True

    def __init__(self, t: Any, keys: list[Hashable], modes: list[tuple[Any, Any]], size: tuple[int, ...]) -> None:
        super().__init__(t, keys)
        self.modes, self.size = modes, size
        self.inner = t.rand_3d_elastic

    def draw_items(self, n: int) -> list[Any]:
        import torch

        from loaders.tail import gauss
        from loaders.tail.plans import Drawn

        early = ahead(self.t, self.inner, "rand_offset", _draws)
        drawn = [resolved(d) for d in (_draws(self.t, self.inner, n, _Like(self.size)) if early is None
                                       else early.take(n, self.size))]  # fmt: skip
        out = []
        for do, _, offset, magnitude, sigma in drawn:
            if not do:
                out.append(Drawn((), {}))
                continue
            sigma32 = np.array([sigma], dtype=np.float32)  # GaussianFilter's float32 sigma
            moved: Any
            if isinstance(offset, uniforms.Uniforms):  # described: made where the plan's work runs
                moved = offset.reshape(1, *offset.shape)
            else:
                held = offset if isinstance(offset, torch.Tensor) else torch.from_numpy(np.asarray(offset))
                moved = held.unsqueeze(0)
            values = {"offset": moved, "sigma": sigma32, "magnitude": np.array([magnitude], np.float32)}
            out.append(Drawn(("deformed", gauss.tail_of(float(sigma32[0]), 3.0)), values))
        if drawn:  # what MONAI's last call leaves on its transform
            self.inner._do_transform = drawn[-1][1]
            self.inner.rand_offset, self.inner.magnitude, self.inner.sigma = drawn[-1][2:]
        return out

    def values_like(self, n: int) -> dict[str, Any]:
        return {}

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        """One item (a batch of one): deformed where `kind` says so (its kernels' half length), else resampled on
        the identity grid, as MONAI resamples every item."""
        import torch
        from monai.networks.layers.simplelayers import separable_filtering
        from monai.transforms import AffineGrid
        from monai.transforms.utils import create_grid

        from loaders.tail import gauss

        first = data[self.keys[0]]
        if first.device.type == "meta":  # the batch's shapes after it: float32, as grid_sample's out
            return {k: torch.empty(data[k].shape, dtype=torch.float32, device="meta") for k in self.keys}
        device = first.device
        if self.inner.device is None:
            self.inner.set_device(device)  # as MONAI's dict transform does at its first call
        grid: Any = create_grid(spatial_size=self.size, device=device, backend="torch")
        if kind:
            k = gauss.kernel(values["sigma"], kind[1], 3.0)
            grid[:3] += separable_filtering(x=values["offset"], kernels=[k, k, k])[0] * values["magnitude"]
            dtype: Any = AffineGrid(dtype=self.inner.rand_affine_grid.dtype).dtype
            grid = grid.to(dtype or grid.dtype)
            affine = torch.eye(len(self.size) + 1, device=device, dtype=grid.dtype)
            grid = (affine @ grid.view((grid.shape[0], -1))).view([-1, *grid.shape[1:]])
        return resampled(self.inner, data, self.keys, self.modes, [grid])
