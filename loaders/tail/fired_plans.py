"""Plans (`loaders.tail.plans`) of the intensity augmentations MONAI's tutorials add after the crop.

Each item's numbers are drawn as `loaders.tail.fired` draws them: the dict transform's prob, then, where it fires,
its inner transform's `randomize`. The work runs on every item from those numbers, with the ops the batched
versions run (`loaders.tail.contrast`, `loaders.tail.histogram`, the bias field's Legendre recurrence), each
item's reductions on that item alone as MONAI reduces it; the items a transform skips are kept by a mask.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from loaders.tail.plans import Drawn, Like, Plan, _meta, fired_kind, on_fired, rows_of


def _fire(t: Any, inner: Any, n: int, draw: Callable[[], Any]) -> list[Any]:
    """Each item's prob drawn and, where it fires, its inner transform's numbers (`draw()`, which gives what the
    work needs of them), in batch order: per item what `draw` gave, or None where the item is left as it is (the dict
    transform or its inner one did not fire)."""
    out: list[Any] = []
    for _ in range(n):
        t.randomize(None)
        if not t._do_transform:
            out.append(None)
            continue
        got = draw()
        out.append(got if getattr(inner, "_do_transform", True) else None)
    return out


def _fired(drawn: list[Any]) -> np.ndarray:
    return np.array([d is not None for d in drawn], dtype=np.bool_)


class _PerItemValue(Plan):
    """A transform whose inner draws one number per item (`attr`), its work per item (`work(x_i, value_i)`, the
    value a float64 device tensor of the host's number)."""

    def __init__(self, t: Any, keys: list[Hashable], inner: Any, attr: str, work: Callable[[Any, Any], Any]) -> None:
        super().__init__(t, keys)
        self.inner, self.attr, self.work = inner, attr, work

    def draw(self, n: int) -> Drawn:
        def draw() -> float:
            self.inner.randomize(None)
            return float(getattr(self.inner, self.attr))

        drawn = _fire(self.t, self.inner, n, draw)
        value = np.array([0.0 if d is None else d for d in drawn], dtype=np.float64)
        fired = _fired(drawn)
        return Drawn(fired_kind(fired), {"fired": fired, "value": value})

    def values_like(self, n: int) -> dict[str, Any]:
        return {"fired": _meta((n,), "bool"), "value": _meta((n,), "float64")}

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        import torch

        value = values["value"]

        def op(x: Any) -> Any:
            def worked(rows_x: Any, rows: Any) -> Any:
                picked = rows_of(value, rows)
                return torch.stack([self.work(rows_x[j], picked[j]) for j in range(len(rows))])

            return worked

        return _each_key(self.keys, data, kind, values["fired"], op)


def _each_key(keys: list[Hashable], data: dict[Hashable, Any], kind: Any, fired: Any,
              op: Callable[[Any], Callable[[Any, Any], Any]]) -> dict[Hashable, Any]:  # fmt: skip
    """Each key's entry with `op(entry)` run on its fired items (`on_fired`); as it is for the shapes alone (meta)."""
    return {k: data[k] if data[k].device.type == "meta" else on_fired(data[k], kind, fired, op(data[k])) for k in keys}


def _std_shifted(inner: Any) -> Callable[[Any, Any], Any]:
    """MONAI's `StdShiftIntensity` (not `nonzero`) on one item: plus factor times its std (each channel's where
    `channel_wise`)."""
    import torch

    def one(img: Any, factor: Any) -> Any:
        factor = factor.to(img.dtype)  # a host number against a tensor: rounded to its dtype
        if inner.channel_wise:
            return torch.stack([c + factor * torch.std(c, unbiased=False) for c in img])
        return img + factor * torch.std(img, unbiased=False)

    return one


def std_shift(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
    inner = t.shifter
    if inner.nonzero or not _keeps_dtype(inner.dtype, like, keys):
        return None
    return _PerItemValue(t, keys, inner, "factor", _std_shifted(inner))


def adjust_contrast(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
    from loaders.tail.contrast import contrasted

    inner = t.adjuster
    return _PerItemValue(t, keys, inner, "gamma_value", lambda x, g: contrasted(inner.adjust_contrast, x, g, None))


def _keeps_dtype(dtype: Any, like: Like, keys: list[Hashable]) -> bool:
    """Whether a transform with `dtype` leaves the entries' dtype (so skipped and fired items agree)."""
    if dtype is None:
        return True
    from loaders.tail.plans import _dtype

    return all(like[k].dtype == _dtype(dtype) for k in keys)


class _Histogram(Plan):
    """RandHistogramShiftd: each fired item's control points; every item mapped (the skipped ones by the identity's
    points, then kept as they were)."""

    def __init__(self, t: Any, keys: list[Hashable], points: int) -> None:
        super().__init__(t, keys)
        self.inner, self.points = t.shifter, points

    def draw(self, n: int) -> Drawn:
        def draw() -> tuple[Any, Any]:
            self.inner.randomize(None)
            return self.inner.reference_control_points, self.inner.floating_control_points

        drawn = _fire(self.t, self.inner, n, draw)
        ref = np.tile(np.linspace(0.0, 1.0, self.points), (n, 1))
        flo = ref.copy()
        for i, d in enumerate(drawn):
            if d is not None:
                ref[i], flo[i] = d
        fired = _fired(drawn)
        return Drawn(fired_kind(fired), {"fired": fired, "reference": ref, "floating": flo})

    def values_like(self, n: int) -> dict[str, Any]:
        return {"fired": _meta((n,), "bool"), "reference": _meta((n, self.points), "float64"),
                "floating": _meta((n, self.points), "float64")}  # fmt: skip

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        from loaders.tail.histogram import mapped

        def op(x: Any) -> Any:
            ref, flo = values["reference"].to(x.dtype), values["floating"].to(x.dtype)
            return lambda rows_x, rows: mapped(rows_x, ref if len(rows) == len(ref) else rows_of(ref, rows),
                                               flo if len(rows) == len(flo) else rows_of(flo, rows))  # fmt: skip

        return _each_key(self.keys, data, kind, values["fired"], op)


def histogram_shift(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
    count = t.shifter.num_control_points  # (least, most): MONAI's form of a count given as one number
    low, high = (count, count) if isinstance(count, int) else count
    if low != high:
        return None  # a count drawn per item: its rows would differ in length
    return _Histogram(t, keys, int(low))


class _BiasField(Plan):
    """RandBiasFieldd: each fired item's Legendre coefficients; every item's field (the skipped ones' zero: a field of
    one), `img * exp(field)` in float64 then the transform's dtype, the fired ones kept."""

    def __init__(self, t: Any, keys: list[Hashable], spatial: tuple[int, ...]) -> None:
        super().__init__(t, keys)
        self.inner, self.spatial = t.rand_bias_field, spatial
        self.side = (self.inner.degree + 1,) * len(spatial)

    def draw(self, n: int) -> Drawn:
        from loaders.tail.fired import _coefficient_mats

        def draw() -> Any:
            self.inner.randomize(img_size=self.spatial)
            return self.inner._coeff

        drawn = _fire(self.t, _Always(), n, draw)
        fired = _fired(drawn)
        mats = np.zeros((n, *self.side))
        if fired.any():
            mats[fired] = _coefficient_mats(len(self.spatial), self.inner.degree, [d for d in drawn if d is not None])
        return Drawn(fired_kind(fired), {"fired": fired, "mats": mats})

    def values_like(self, n: int) -> dict[str, Any]:
        return {"fired": _meta((n,), "bool"), "mats": _meta((n, *self.side), "float64")}

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        import torch
        from monai.utils import get_equivalent_dtype

        from loaders.tail.fired import fields_of

        first = data[self.keys[0]]
        if first.device.type == "meta":
            return {k: data[k] for k in self.keys}
        made: dict[int, Any] = {}  # the fields of the rows worked on, made once for every key

        def fields(rows: Any) -> Any:
            if len(rows) not in made:
                mats = values["mats"] if len(rows) == len(values["mats"]) else rows_of(values["mats"], rows)
                made[len(rows)] = torch.exp(fields_of(self.spatial, mats))
            return made[len(rows)]

        out = {}
        for k in self.keys:
            x = data[k]
            dtype = get_equivalent_dtype(self.inner.dtype, torch.Tensor) if self.inner.dtype is not None else x.dtype

            def biased(v: Any, rows: Any, dtype: Any = dtype) -> Any:
                return (v.to(torch.float64) * fields(rows)).to(dtype)

            out[k] = on_fired(x, kind, values["fired"], biased)
        return out


class _Always:
    """An inner transform that always fires (RandBiasFieldd's is drawn with its dict transform's prob only)."""

    _do_transform = True


def bias_field(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
    spatial = tuple(int(s) for s in like[keys[0]].shape[2:])
    inner = t.rand_bias_field
    if len(spatial) not in (2, 3) or any(tuple(like[k].shape[2:]) != spatial for k in keys):
        return None
    if not _keeps_dtype(inner.dtype, like, keys):
        return None
    return _BiasField(t, keys, spatial)
