"""Random transforms with no one-op batched form that change only the items they fire on (`prob` < 1 in most
tutorial tails): `RandZoomd` and `RandGaussianSmoothd` (the DynUNet tutorial's tail, `prob=0.15`), `RandRotated`.

Each item's numbers are drawn through the MONAI transforms' own `randomize`, item by item in batch order, as
MONAI's dict transform draws them; then MONAI's own array transform (`randomize=False`, the item's draws put
back) runs on each item it fired on, and every other item stays as MONAI leaves it (the input; as float32
where MONAI converts it). The per-item MONAI path ran the whole dict transform on every item and split and
stacked the batch around it; here the items it skips cost nothing and the batch stays stacked.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from loaders.tail.device import rows_of, to_device
from loaders.tail.plans import MatrixPlan
from loaders.tail.tailbatch import TailBatch, _plain, _stack, keys_of

Apply = Callable[[Hashable, Any], Any]  # (key, item tensor) -> MONAI's output for that item


def ready(t: Any, batch: TailBatch) -> list[Hashable] | None:
    keys = keys_of(t, batch)
    if getattr(t, "lazy", False) is not False or not all(batch.is_batched(k) for k in keys):
        return None
    return keys


def assemble(batch: TailBatch, keys: list[Hashable], fired: dict[int, Apply], skipped: Callable[[Any], Any]) -> None:
    """Each key's rows: MONAI's output where it fired, `skipped(row)` elsewhere; stacked where shapes and
    dtypes agree, else the batch goes on item by item (as the per-item path would leave it)."""
    rows: dict[Hashable, list[Any]] = {}
    for k in keys:
        x = batch.data[k]
        rows[k] = [_plain(fired[i](k, row_of(batch, k, i))) if i in fired else skipped(x[i]) for i in range(batch.n)]
    stacked = {k: _stack(v, promote=False) for k, v in rows.items()}
    if all(s is not None for s in stacked.values()):
        batch.data.update(stacked)
        return
    items = [batch.item(i) for i in range(batch.n)]
    for k, v in rows.items():
        for item, row in zip(items, v):
            item[k] = row
    batch.set_items(items, list(range(batch.n)))


def taken(out: dict[Hashable, Any]) -> Apply:
    """An item's `Apply` that hands back what was already made for it, key by key."""
    return lambda k, x: out[k]


def row_of(batch: TailBatch, key: Hashable, i: int) -> Any:
    """Item i's tensor as MONAI's chain would hand it over (a copy where it views the caller's batch)."""
    return batch.item(i)[key]


def rand_zoom(t: Any, batch: TailBatch) -> bool:
    """RandZoomd: the dict's prob and the inner RandZoom's factors drawn for every item (MONAI draws the
    factors whether or not the item is zoomed); MONAI's RandZoom on the zoomed items, float32 for the rest."""
    import torch

    keys = ready(t, batch)
    if keys is None:
        return False
    if not keys:
        return True  # MONAI returns such an item without drawing
    inner, first = t.rand_zoom, batch.data[keys[0]]
    drawn: dict[int, tuple[bool, Any]] = {}
    for i in range(batch.n):
        t.randomize(None)
        inner.randomize(first[i])
        if t._do_transform:
            drawn[i] = (inner._do_transform, inner._zoom)
    options = {k: o for k, *o in t.key_iterator(batch.data, t.mode, t.padding_mode, t.align_corners, t.dtype)}

    def zoomed(i: int) -> Apply:
        def apply(k: Hashable, x: Any) -> Any:
            inner._do_transform, inner._zoom = drawn[i]
            mode, padding_mode, align_corners, dtype = options[k]
            return inner(x, mode, padding_mode, align_corners, dtype, randomize=False, lazy=False)

        return apply

    assemble(batch, keys, {i: zoomed(i) for i in drawn}, lambda x: x.to(torch.float32))
    return True


def rand_gaussian_smooth(t: Any, batch: TailBatch) -> bool:
    """RandGaussianSmoothd: the dict's prob for every item, the inner sigmas for the items it fires on (as
    MONAI draws them); MONAI's GaussianSmooth on those items, the rest as they are."""
    keys = ready(t, batch)
    if keys is None:
        return False
    inner = t.rand_smooth
    drawn: dict[int, tuple[bool, float, float, float]] = {}
    for i in range(batch.n):
        t.randomize(None)
        if t._do_transform:
            inner.randomize(None)
            drawn[i] = (inner._do_transform, inner.x, inner.y, inner.z)
    if not drawn:
        return True

    def smoothed(i: int) -> Apply:
        def apply(k: Hashable, x: Any) -> Any:
            inner._do_transform, inner.x, inner.y, inner.z = drawn[i]
            return inner(x, randomize=False)

        return apply

    assemble(batch, keys, {i: smoothed(i) for i in drawn}, lambda x: x)
    return True


def rand_rotate(t: Any, batch: TailBatch) -> bool:
    """RandRotated: the dict's prob and the inner RandRotate's angles drawn for every item (MONAI draws the
    angles whether or not the item turns, and for an item without the keys too); the turned items resampled
    together with MONAI's own matrices and `AffineTransform` where the size is kept (else MONAI's RandRotate
    item by item), float32 for the rest."""
    import torch

    keys = ready(t, batch)
    if keys is None:
        return False
    inner = t.rand_rotate
    drawn: dict[int, tuple[bool, float, float, float]] = {}
    for i in range(batch.n):
        t.randomize(None)
        inner.randomize()
        if t._do_transform:
            drawn[i] = (inner._do_transform, inner.x, inner.y, inner.z)
    options = {k: o for k, *o in t.key_iterator(batch.data, t.mode, t.padding_mode, t.align_corners, t.dtype)}
    if inner.keep_size and drawn:
        thetas: dict[Any, Any] = {}  # the keys' matrices, normalized once for all keys of one size and dtype
        turned = {k: _rotated(inner, batch.data[k], drawn, thetas, *options[k]) for k in keys}

        def row(j: int) -> Apply:
            return lambda k, x: turned[k][j]

        assemble(batch, keys, {i: row(j) for j, i in enumerate(drawn)}, lambda x: x.to(torch.float32))
        return True

    def one(i: int) -> Apply:
        def apply(k: Hashable, x: Any) -> Any:
            inner._do_transform, inner.x, inner.y, inner.z = drawn[i]
            mode, padding_mode, align_corners, dtype = options[k]
            return inner(x, mode=mode, padding_mode=padding_mode, align_corners=align_corners, dtype=dtype,
                         randomize=False, lazy=False)  # fmt: skip

        return apply

    assemble(batch, keys, {i: one(i) for i in drawn}, lambda x: x.to(torch.float32))
    return True


def _rotated(
    inner: Any, x: Any, drawn: dict[int, tuple[bool, float, float, float]], thetas: dict[Any, Any], *options: Any
) -> Any:
    """The items of `x` that `drawn` turns, rotated in one resampling: each item's matrix as MONAI's `rotate`
    builds it (the rotation about the centre, the output the input's size), `AffineTransform` over them all.
    `thetas`: the matrices normalized by MONAI's `to_norm_affine` as `AffineTransform` normalizes them, kept for
    the next key of the same size, dtype, device and corners (image and label: one normalization, not two)."""
    import torch
    from monai.networks.layers import AffineTransform
    from monai.transforms.utils import resolves_modes
    from monai.utils import get_equivalent_dtype

    mode, padding_mode, align_corners, dtype = options
    sp = tuple(int(s) for s in x.shape[2:])
    _, m, p, _ = resolves_modes(mode or inner.mode, padding_mode or inner.padding_mode)
    corners = inner.align_corners if align_corners is None else align_corners
    # MONAI's rotation reverses the matrices' spatial rows and columns (`reverse_indexing=True`) with an index
    # copied from pageable memory; reversed here once by `flip`, the same numbers moved, no host wait
    xform = AffineTransform(normalized=True, mode=m, padding_mode=p, align_corners=corners, reverse_indexing=False)
    img = rows_of(x, list(drawn)).to(get_equivalent_dtype(dtype or inner.dtype or x.dtype, torch.Tensor))
    at = (sp, img.dtype, img.device, corners)
    if at not in thetas:
        theta = to_device(torch.as_tensor(_matrices(sp, drawn), dtype=img.dtype), img.device)
        thetas[at] = _reversed(_normalized(theta, sp, corners, xform.zero_centered), len(sp))
    return xform(img, thetas[at], spatial_size=sp).float()


def _reversed(theta: Any, sr: int) -> Any:
    """`AffineTransform`'s `reverse_indexing`: the first `sr` rows, then the first `sr` columns, in reverse order."""
    out = theta.clone()
    out[:, :sr] = out[:, :sr].flip(1)
    out[:, :, :sr] = out[:, :, :sr].flip(2)
    return out


def _normalized(theta: Any, size: tuple[int, ...], corners: bool, zero_centered: bool) -> Any:
    """MONAI's `to_norm_affine(theta, size, size, ...)`: its normalizing matrix and that matrix's inverse made on
    the host by MONAI's own `normalize_transform` and numpy, as MONAI makes the inverse (MONAI makes the first on
    the device, from host copies the host waits for; elementwise float64 steps, the same numbers on either), both
    copied to the device from pinned memory and multiplied there in MONAI's order."""
    import numpy as np
    import torch
    from monai.networks.utils import normalize_transform

    norm = normalize_transform(size, "cpu", theta.dtype, corners, zero_centered)
    inverse = torch.as_tensor(np.linalg.inv(norm.numpy()), dtype=theta.dtype)
    return to_device(norm, theta.device) @ theta @ to_device(inverse, theta.device)


def _matrices(sp: tuple[int, ...], drawn: dict[int, tuple[bool, float, float, float]]) -> Any:
    """Each turned item's rotation about the centre of a `sp`-sized image, as MONAI's `rotate` builds it."""
    import numpy as np
    from monai.transforms.utils import create_rotate, create_translate

    nd = len(sp)
    centre = create_translate(nd, ((np.array(sp) - 1) / 2).tolist())
    back = create_translate(nd, (-(np.asarray(sp, dtype=int) - 1) / 2).tolist())
    mats = []
    for _, ax, ay, az in drawn.values():
        angle = (ax,) if nd == 2 else (ax, ay, az)
        mats.append(centre @ create_rotate(nd, angle) @ back)  # MONAI's default order (1.4 has no other)
    return np.stack(mats)


def plan_rotate(t: Any, keys: list[Hashable], like: Any) -> Any:
    """RandRotated's plan (`loaders.tail.plans`) where it keeps the size: each item's matrix as `rand_rotate` draws
    and builds it (the identity where it does not turn), the items resampled by MONAI's `AffineTransform` with their
    matrices normalized item by item as MONAI normalizes each, the turned ones kept (the others as float32)."""
    inner = t.rand_rotate
    shapes = {tuple(like[k].shape[2:]) for k in keys}
    if not inner.keep_size or len(shapes) != 1 or len(next(iter(shapes))) not in (2, 3):
        return None
    return _RotatePlan(t, keys, next(iter(shapes)))


class _RotatePlan(MatrixPlan):
    matrix = ("theta", "float64")

    def __init__(self, t: Any, keys: list[Hashable], size: tuple[int, ...]) -> None:
        super().__init__(t, keys, size)
        self.inner = t.rand_rotate
        self.options = {k: o for k, *o in t.key_iterator({k: None for k in keys}, t.mode, t.padding_mode,
                                                         t.align_corners, t.dtype)}  # fmt: skip

    def fire(self) -> Any:
        """`rand_rotate`'s draws for one item (the angles drawn whether or not it turns): its matrix where it does."""
        self.t.randomize(None)
        self.inner.randomize()
        if not self.t._do_transform:
            return None
        inner = self.inner
        return _matrices(self.size, {0: (inner._do_transform, inner.x, inner.y, inner.z)})[0]

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        import torch
        from monai.networks.layers import AffineTransform
        from monai.transforms.utils import resolves_modes
        from monai.utils import get_equivalent_dtype

        from loaders.tail.plans import on_fired, rows_of

        if data[self.keys[0]].device.type == "meta":
            return {k: torch.empty(data[k].shape, dtype=torch.float32, device="meta") for k in self.keys}
        inner, sp, out = self.inner, self.size, {}
        for k in self.keys:
            mode, padding_mode, align_corners, dtype = self.options[k]
            _, m, p, _ = resolves_modes(mode or inner.mode, padding_mode or inner.padding_mode)
            corners = inner.align_corners if align_corners is None else align_corners
            xform = AffineTransform(normalized=True, mode=m, padding_mode=p, align_corners=corners,
                                    reverse_indexing=False)  # fmt: skip
            x = data[k]
            to = get_equivalent_dtype(dtype or inner.dtype or x.dtype, torch.Tensor)

            def turned(v: Any, rows: Any, to: Any = to, xform: Any = xform, corners: Any = corners) -> Any:
                theta = rows_of(values["theta"], rows).to(to)  # each item's normalized as MONAI normalizes one
                norm = torch.cat([_normalized(theta[j : j + 1], sp, corners, xform.zero_centered)
                                  for j in range(len(rows))])  # fmt: skip
                return xform(v.to(to), _reversed(norm, len(sp)), spatial_size=sp).float()

            out[k] = on_fired(x, kind, values["fired"], turned, lambda v: v.to(torch.float32))
        return out
