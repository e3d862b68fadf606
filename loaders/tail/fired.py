"""The intensity augmentations MONAI's tutorials add after the crop, run on the items they fire on.

`RandAdjustContrastd`, `RandHistogramShiftd`, `RandGaussianSharpend`, `RandStdShiftIntensityd`,
`RandCoarseDropoutd` and `RandBiasFieldd` fire on a fraction of the items (`prob` 0.1-0.3 in the tutorials).
Each item's numbers are drawn as MONAI's dict transform draws them (its prob, then, where it fires, its inner
transform's numbers), item by item in batch order. The items it skips stay as they are, as MONAI leaves them; on
the items it fires on MONAI's own array transform runs with the item's draws put back (`randomize=False`), except
the bias field: MONAI computes it in numpy on the host (a device tensor goes down and up again per item), so it
is evaluated here for all fired items at once, where the batch is, with the same Legendre recurrence in float64.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from loaders.tail.device import to_device
from loaders.tail.sparse import Apply, assemble, ready, row_of, taken
from loaders.tail.tailbatch import TailBatch

Draws = dict[int, dict[str, Any]]  # fired item -> the inner transform's attributes as its draw left them


def _drawn(inner: Any) -> dict[str, Any]:
    """What `randomize` leaves on an inner transform (its numbers and flags), to be put back before applying."""
    return {k: v for k, v in vars(inner).items() if k != "R"}


def _fire(t: Any, batch: TailBatch, draw: Callable[[int], Any] | None) -> Draws:
    """The dict transform's prob for every item and, on the items it fires on, `draw(i)` (the inner's numbers;
    None where MONAI draws nothing more), in batch order as MONAI's per-item chain draws them."""
    fired: Draws = {}
    for i in range(batch.n):
        t.randomize(None)
        if t._do_transform:
            fired[i] = draw(i) if draw is not None else {}
    return fired


def _fired_without_image(t: Any, batch: TailBatch, inner: Any) -> Draws:
    """`_fire` for an inner transform whose numbers need no image (`randomize(None)`)."""

    def draw(i: int) -> dict[str, Any]:
        inner.randomize(None)
        return _drawn(inner)

    return _fire(t, batch, draw)


def _inner(t: Any, name: str) -> Any:
    return getattr(t, name, None)


def _monais(inner: Any, x: Any) -> Any:
    return inner(x, randomize=False)


def _put_back(inner: Any, fired: Draws, run: Callable[[Any, Any], Any] = _monais) -> dict[int, Apply]:
    """`run(inner, x)` (MONAI's array transform) on each fired item, with that item's draws put back."""

    def one(i: int) -> Apply:
        def apply(k: Hashable, x: Any) -> Any:
            vars(inner).update(fired[i])
            return run(inner, x)

        return apply

    return {i: one(i) for i in fired}


def _drawn_without_image(t: Any, batch: TailBatch, name: str, run: Callable[[Any, Any], Any] = _monais) -> bool:
    """Dict transforms whose inner draws need no image (`randomize(None)`): contrast, histogram shift,
    sharpening, std shift. MONAI draws the inner's numbers for a fired item whatever its keys hold."""
    keys, inner = ready(t, batch), _inner(t, name)
    if keys is None or inner is None:
        return False
    fired = _fired_without_image(t, batch, inner)
    if keys and fired:
        assemble(batch, keys, _put_back(inner, fired, run), lambda x: x)
    return True


def rand_adjust_contrast(t: Any, batch: TailBatch) -> bool:
    """RandAdjustContrastd: MONAI's gamma on the items it fires on, with no read on a CUDA device and each item's
    range read once a batch for all on the CPU (`loaders.tail.contrast`), or MONAI's own transform for keys
    neither float32 nor float64."""
    from loaders.tail.contrast import adjusted
    from loaders.tail.device import float_keys, item_spans

    keys, inner = ready(t, batch), _inner(t, "adjuster")
    if keys is None or inner is None:
        return False
    if not keys or not float_keys(batch, keys):
        return _drawn_without_image(t, batch, "adjuster")
    fired = _fired_without_image(t, batch, inner)
    if fired:
        on_cuda = all(batch.data[k].is_cuda for k in keys)
        span = None if on_cuda else item_spans(batch, keys)

        def one(i: int) -> Apply:
            def apply(k: Hashable, x: Any) -> Any:
                vars(inner).update(fired[i])
                return adjusted(inner, x, None if span is None else span[k][i])

            return apply

        assemble(batch, keys, {i: one(i) for i in fired}, lambda x: x)
    return True


def rand_histogram_shift(t: Any, batch: TailBatch) -> bool:
    """RandHistogramShiftd: MONAI's control points drawn per item; the mapping of all the items it fires on at
    once where every key is floating (`loaders.tail.histogram`), else MONAI's mapping on each."""
    from loaders.tail.histogram import shifted

    keys, inner = ready(t, batch), _inner(t, "shifter")
    if keys is None or inner is None:
        return False
    if not keys or not all(batch.data[k].is_floating_point() for k in keys):
        return _drawn_without_image(t, batch, "shifter")
    fired = _fired_without_image(t, batch, inner)
    if fired:
        items = list(fired)
        done = {k: shifted(batch.data[k], items, [fired[i] for i in items]) for k in keys}
        assemble(batch, keys, {i: taken({k: done[k][j] for k in keys}) for j, i in enumerate(items)}, lambda x: x)
    return True


def rand_gaussian_sharpen(t: Any, batch: TailBatch) -> bool:
    """RandGaussianSharpend: MONAI's sigmas drawn per item; the filters' kernels of every item it fires on made
    at once, with no host wait (`loaders.tail.sharpen`), then MONAI's filtering and sharpening sum on each."""
    from loaders.tail.sharpen import filter_kernels, sharpened

    keys, inner = ready(t, batch), _inner(t, "rand_sharpen")
    if keys is None or inner is None:
        return False
    fired = _fired_without_image(t, batch, inner)
    applied = [i for i in fired if fired[i]["_do_transform"]]
    if not keys or not applied:
        return True
    made: dict[int, list[list[Any]]] = {}  # an item's ndim -> each applied item's kernels

    def kernels(i: int, x: Any) -> list[Any]:
        if x.ndim not in made:
            made[x.ndim] = filter_kernels(inner.approx, [fired[j] for j in applied], x.ndim - 1, x.device)
        return made[x.ndim][applied.index(i)]

    def one(i: int) -> Apply:
        def apply(k: Hashable, x: Any) -> Any:
            vars(inner).update(fired[i])
            return sharpened(inner, x, kernels(i, x)) if i in applied else x

        return apply

    assemble(batch, keys, {i: one(i) for i in fired}, lambda x: x)
    return True


def rand_std_shift_intensity(t: Any, batch: TailBatch) -> bool:
    """RandStdShiftIntensityd: MONAI's factor times the item's std on the items it fires on."""
    return _drawn_without_image(t, batch, "shifter")


def rand_coarse_dropout(t: Any, batch: TailBatch) -> bool:
    """RandCoarseDropoutd: holes drawn per fired item, and filled right after (a random fill draws from the same
    state while filling, so each item's holes and fills come before the next item's holes): where the batch is,
    with no read back (or one a batch where numpy's uniform is not the plain affine map: `loaders.tail.dropout`),
    or by MONAI's own transform for keys neither float32 nor float64."""
    from loaders.tail.device import device_spans, float_keys, item_spans
    from loaders.tail.dropout import filled, uniform_is_affine

    keys, inner = ready(t, batch), _inner(t, "dropper")
    if keys is None or inner is None:
        return False
    if not keys:  # MONAI draws the prob only
        _fire(t, batch, None)
        return True
    done: dict[int, dict[Hashable, Any]] = {}
    here = float_keys(batch, keys)
    spans: dict[Hashable, list[tuple[float, float]]] = {}  # read at the first item that fires, if any does

    def draw(i: int) -> dict[str, Any]:
        inner.randomize(tuple(batch.data[keys[0]].shape[2:]))
        if here and inner.fill_value is None and not spans:
            spans.update(device_spans(batch, keys) if uniform_is_affine() else item_spans(batch, keys))
        if here:
            done[i] = {k: filled(inner, row_of(batch, k, i), spans[k][i] if spans else None, batch.checks)
                       for k in keys}  # fmt: skip
        else:
            done[i] = {k: inner(row_of(batch, k, i), randomize=False) for k in keys}
        return {}

    fired = _fire(t, batch, draw)
    assemble(batch, keys, {i: taken(done[i]) for i in fired}, lambda x: x)
    return True


def fired_whole(t: Any, batch: TailBatch) -> bool:
    """MONAI's own dict transform on each item it fires on, called right after that item's prob is drawn (so the
    inner's draws, in the transform's own order per key, come before the next item's prob, as in MONAI's chain);
    the items it skips stay as they are (as float32 for RandSimulateLowResolutiond, which converts them).
    RandGibbsNoised, RandKSpaceSpikeNoised, RandRicianNoised, RandCoarseShuffled, RandSimulateLowResolutiond,
    RandLambdad."""
    import torch

    keys = ready(t, batch)
    if keys is None:
        return False
    to_float = type(t).__name__ == "RandSimulateLowResolutiond"
    if to_float and not keys:
        return True  # MONAI returns such an item without drawing
    outs: dict[int, dict[Hashable, Any]] = {}
    for i in range(batch.n):
        t.randomize(None)
        if t._do_transform:
            outs[i] = _as_fired(t, batch.item(i))
    if keys:
        skipped = (lambda x: x.to(torch.float32)) if to_float else (lambda x: x)
        assemble(batch, keys, {i: taken(outs[i]) for i in outs}, skipped)
    return True


def _as_fired(t: Any, item: dict[Hashable, Any]) -> dict[Hashable, Any]:
    """MONAI's dict transform on `item`, its prob (drawn already: it fires) not drawn again."""
    t.randomize = lambda *_: None
    try:
        return dict(t(item))
    finally:
        del t.randomize


def rand_bias_field(t: Any, batch: TailBatch) -> bool:
    """RandBiasFieldd: MONAI's coefficients per fired item; the fields of all fired items evaluated at once where
    the batch is (float64, the Legendre recurrence numpy's `leggrid2d`/`leggrid3d` run), then `img * exp(field)`
    in float64 as MONAI computes it, in the transform's dtype."""
    import torch
    from monai.utils import get_equivalent_dtype

    keys, inner = ready(t, batch), _inner(t, "rand_bias_field")
    if keys is None or inner is None:
        return False
    if not keys:
        _fire(t, batch, None)
        return True
    spatial = tuple(int(s) for s in batch.data[keys[0]].shape[2:])
    if len(spatial) not in (2, 3) or any(tuple(batch.data[k].shape[2:]) != spatial for k in keys):
        return False

    def draw(i: int) -> dict[str, Any]:
        inner.randomize(img_size=spatial)
        return _drawn(inner)

    fired = _fire(t, batch, draw)
    if not fired:
        return True
    device = batch.data[keys[0]].device
    fields = torch.exp(bias_fields(spatial, inner.degree, [fired[i]["_coeff"] for i in fired], device))
    rows = {i: j for j, i in enumerate(fired)}

    def apply(i: int) -> Apply:
        def one(k: Hashable, x: Any) -> Any:
            out = x.to(torch.float64) * fields[rows[i]]
            return out.to(get_equivalent_dtype(inner.dtype, torch.Tensor) if inner.dtype is not None else x.dtype)

        return one

    assemble(batch, keys, {i: apply(i) for i in fired}, lambda x: x)
    return True


def _coefficient_mats(rank: int, degree: int, coeffs: list[list[float]]) -> Any:
    """Each item's Legendre coefficients as the (degree+1)^rank matrix MONAI fills (total degree <= degree)."""
    import numpy as np

    mats = np.zeros((len(coeffs),) + (degree + 1,) * rank)
    if rank == 2:
        where: Any = np.tril_indices(degree + 1)
    else:
        pts = [(i, j, k) for i in range(degree + 1) for j in range(degree + 1 - i) for k in range(degree + 1 - i - j)]
        where = tuple(np.array(pts).T)
    for m, c in zip(mats, coeffs):
        m[where] = c
    return mats


def _legval(x: Any, c: Any) -> Any:
    """numpy's `legval(x, c, tensor=True)` over a leading batch axis: c (n, m, *rest) -> (n, *rest, len(x)), the
    same Clenshaw steps in the same order, one torch op each (no fused multiply-add)."""
    c = c.reshape(*c.shape, 1)
    m = int(c.shape[1])
    if m == 1:
        return c[:, 0] + 0 * x
    c0, c1 = c[:, -2], c[:, -1]
    nd = m
    for i in range(3, m + 1):
        tmp = c0
        nd = nd - 1
        c0 = c[:, -i] - (c1 * (nd - 1)) / nd
        c1 = tmp + (c1 * x * (2 * nd - 1)) / nd
    return c0 + c1 * x


def bias_fields(spatial: tuple[int, ...], degree: int, coeffs: list[list[float]], device: Any) -> Any:
    """The bias fields (n, 1, *spatial), float64, of MONAI's RandBiasField for each coefficient list."""
    import torch

    return fields_of(spatial, to_device(torch.from_numpy(_coefficient_mats(len(spatial), degree, coeffs)), device))


def fields_of(spatial: tuple[int, ...], c: Any) -> Any:
    """The bias fields (n, 1, *spatial), float64, of coefficient matrices `c` (`_coefficient_mats`, on the device)."""
    import numpy as np
    import torch

    device = c.device
    for dim in spatial:
        x = to_device(torch.from_numpy(np.linspace(-1.0, 1.0, dim, dtype=np.float32)), device)
        c = _legval(x, c)
    return c.unsqueeze(1)
