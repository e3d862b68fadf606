"""Random transforms split in two, for a tail replayed as CUDA graphs (`loaders.tail.replay`).

A plan's `draw` makes a batch's numbers on the host, by the MONAI transform's own `randomize`, item by item in
batch order as MONAI's per-item chain draws them. Its `apply` does the work on the device from those numbers
alone, with the same kernels whatever was drawn: every item is computed, and the items the transform skips are
kept by a mask (`torch.where` picks, bit for bit, what MONAI leaves as it was). So one graph, captured once per
`Drawn.kind` (what the kernels depend on beyond the batch's shapes: nothing, for the plans here), serves every
batch. A transform, or an input, that no plan here covers has none (`plan_of` gives None): its tail runs as
`loaders.tail.batched` runs it.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

Like = dict[Hashable, Any]  # a batch's entries as meta tensors: their shapes and dtypes, no data


@dataclass(frozen=True)
class Drawn:
    """A batch's numbers for one transform: `kind` (hashable) picks its graph, `values` are copied up to it (numpy
    arrays, or page-locked host tensors of many numbers, copied up as they are)."""

    kind: Hashable
    values: dict[str, Any]


AS_IS = ("as is",)  # a per-item plan's kind for an item it leaves as it is: nothing launched for it


class Plan:
    """One transform's draws and work. `keys`: the batch entries it reads and writes. A plan `per_item` draws a
    `Drawn` for each item (`draw_items`) and works on one item at a time (a batch of one), its graphs captured for
    each row and kind: where what the kernels depend on differs by item (a kernel's length drawn per item)."""

    per_item = False
    follows = False  # a later part of another plan (`parts`): its draws made with the first part's (`draw_all`)
    eager = False
    graphed = True  # False: its work runs eagerly from its draws, between the graphs (`loaders.tail.drawn_plans`)
    exact_on_cuda = (
        True  # its work on a CUDA device shown bit for bit MONAI's there (tests/loaders/test_tail_replay.py)
    )

    def __init__(self, t: Any, keys: list[Hashable]) -> None:
        self.t, self.keys = t, keys
        # device flags where MONAI would have raised, left by a plan's work (`loaders.tail.checks`)
        self.checks: list[tuple[Any, BaseException]] = []

    def parts(self) -> list[Plan]:
        """The plans this one runs as, in turn (itself; or its parts, where splitting its work in steps keeps the
        kinds of each step's graphs few)."""
        return [self]

    def draw_all(self, n: int) -> list[Any]:
        """The draws of each of `parts`, in turn: each a `Drawn`, or a per-item part's list of them."""
        return [self.draw_items(n) if self.per_item else self.draw(n)]

    def draw(self, n: int) -> Drawn:
        raise NotImplementedError

    def draw_items(self, n: int) -> list[Drawn]:
        """A per-item plan's draws, item by item (values: arrays, or pinned host tensors copied up as they are)."""
        raise NotImplementedError

    def values_like(self, n: int) -> dict[str, Any]:
        """What `draw(n)` gives, as meta tensors of its shapes and dtypes (nothing drawn)."""
        raise NotImplementedError

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        """The entries it changed, from `data` (never written), `values` (the draws, on the batch's device) and
        `kind` (the draw's: its graph's)."""
        raise NotImplementedError


class MatrixPlan(Plan):
    """A plan whose draw is a matrix for each item it fires on, the identity for the others (`fire`: one item's
    draws, in the transform's order; its matrix where it fires, else None)."""

    matrix = ("mats", "float32")  # the value's name and dtype
    # RandAffined's grids from these matrices came out up to 5.4e-7 from MONAI's on an H200 (equal on the CPU): on a
    # CUDA device a tail with such a plan runs as it otherwise would, until its grids are shown equal there
    exact_on_cuda = False

    def __init__(self, t: Any, keys: list[Hashable], size: tuple[int, ...]) -> None:
        super().__init__(t, keys)
        self.size = size

    def fire(self) -> Any:
        raise NotImplementedError

    def draw(self, n: int) -> Drawn:
        name, dtype = self.matrix
        fired = np.zeros(n, dtype=np.bool_)
        mats = np.tile(np.eye(len(self.size) + 1, dtype=dtype), (n, 1, 1))
        for i in range(n):
            m = self.fire()
            if m is not None:
                fired[i], mats[i] = True, m
        return Drawn(fired_kind(fired), {"fired": fired, name: mats})

    def values_like(self, n: int) -> dict[str, Any]:
        name, dtype = self.matrix
        side = len(self.size) + 1
        return {"fired": _meta((n,), "bool"), name: _meta((n, side, side), dtype)}


def _meta(shape: tuple[int, ...], dtype: str) -> Any:
    import torch

    return torch.empty(shape, dtype=getattr(torch, dtype), device="meta")


def fired_kind(fired: np.ndarray) -> Hashable:
    """The kind of a draw whose work runs on the fired items (`on_fired`): how many fired, where the batch has at most
    `loaders.tunables.TAIL_PATTERNS` items (their rows picked where the graph runs, from the mask: one graph a count,
    whichever rows), or () for every item."""
    from loaders import tunables

    return ("fired", int(np.count_nonzero(fired))) if len(fired) <= tunables.TAIL_PATTERNS else ()


def fired_count(kind: Any) -> int | None:
    """How many items fired, where a draw's kind says its work runs on those alone (`fired_kind`), or None (every
    item, the fired kept by a mask)."""
    return kind[1] if isinstance(kind, tuple) and kind[:1] == ("fired",) else None


def rows_of(x: Any, rows: Sequence[int]) -> Any:
    """Rows `rows` of a batch tensor (`loaders.tail.device.rows_of`: picked by a device index, `Picked`; or, a list
    of numbers, in a capture its index a constant held with the graph)."""
    from loaders.tail.device import rows_of as picked

    return picked(x, rows)


def on_fired(x: Any, kind: Any, fired: Any, op: Callable[[Any, Sequence[int]], Any],
             rest: Callable[[Any], Any] = lambda v: v) -> Any:  # fmt: skip
    """`op(rows of x, rows)` on the fired items, `rest` of the others: where `kind` holds how many fired, `op` runs on
    those alone (their rows picked from the mask and put back by an index copy); else on every item, the fired kept
    by the mask."""
    import torch

    n = int(x.shape[0])
    count = fired_count(kind)
    if count is None:
        return _kept(fired, op(x, range(n)), rest(x))
    if count == 0:
        return rest(x)
    if count == n:
        return op(x, range(n))
    from loaders.tail.device import Picked, fired_index

    rows = Picked(fired_index(fired, count))
    done = op(rows_of(x, rows), rows)
    others = rest(x)
    common = torch.promote_types(done.dtype, others.dtype)
    return others.to(common).index_copy(0, rows.at, done.to(common))


def _kept(fired: Any, done: Any, x: Any) -> Any:
    """`done` on the items that fired ((n,) bools), `x` on the others."""
    import torch

    return torch.where(fired.view(-1, *([1] * (x.ndim - 1))), done, x)


class _Flip(Plan):
    """RandFlipd: the same axes flipped on every item that draws a flip."""

    def __init__(self, t: Any, keys: list[Hashable], like: Like) -> None:
        from loaders.tail.tailbatch import spatial_batch_axes

        super().__init__(t, keys)
        self.dims = {k: spatial_batch_axes(like[k].ndim - 1, t.flipper.spatial_axis) for k in keys}

    def draw(self, n: int) -> Drawn:
        from loaders.tail.flips import flip_draws

        return Drawn((), {"fired": np.array(flip_draws(self.t, n), dtype=np.bool_)})

    def values_like(self, n: int) -> dict[str, Any]:
        return {"fired": _meta((n,), "bool")}

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        import torch

        return {k: _kept(values["fired"], torch.flip(data[k], self.dims[k]), data[k]) for k in self.keys}


class _Rotate90(Plan):
    """RandRotate90d on square planes: each item's turns drawn (0 where it does not fire), every turn made for
    every item and the drawn one kept."""

    def __init__(self, t: Any, keys: list[Hashable], like: Like) -> None:
        from loaders.tail.tailbatch import spatial_batch_axes

        super().__init__(t, keys)
        self.axes = {k: tuple(spatial_batch_axes(like[k].ndim - 1, t.spatial_axes)) for k in keys}

    def draw(self, n: int) -> Drawn:
        from loaders.tail.flips import rotate90_draws

        return Drawn((), {"turns": np.array(rotate90_draws(self.t, n), dtype=np.int64)})

    def values_like(self, n: int) -> dict[str, Any]:
        return {"turns": _meta((n,), "int64")}

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        import torch

        out = {}
        for k in self.keys:
            x = out[k] = data[k]
            for q in (1, 2, 3):
                out[k] = _kept(values["turns"] == q, torch.rot90(x, q, self.axes[k]), out[k])
        return out


class _Scalar(Plan):
    """RandScaleIntensityd (v * (1 + factor)) and RandShiftIntensityd (v + offset): one op over the batch with
    each item's number (per channel where drawn so), the skipped items' the op's neutral (x * 1 and x + 0 are x;
    -0.0 + 0 is 0.0, equal)."""

    def __init__(self, t: Any, keys: list[Hashable], like: Like, inner: Any, attr: str, op: Callable[..., Any],
                 neutral: float, plus_one: bool) -> None:  # fmt: skip
        super().__init__(t, keys)
        self.inner, self.attr, self.op, self.neutral, self.plus_one = inner, attr, op, neutral, plus_one
        self.item = like[keys[0]][0]  # what the inner transform's randomize is given (its shape: channels)
        self.width = int(self.item.shape[0]) if getattr(inner, "channel_wise", False) else 1

    def values_like(self, n: int) -> dict[str, Any]:
        return {"table": _meta((n, self.width), "float64")}

    def draw(self, n: int) -> Drawn:
        from loaders.tail.intensity import draws

        rows = []
        for d in draws(self.t, self.inner, self.attr, [self.item] * n):
            if d is None:
                rows.append([self.neutral])
            else:
                row = list(d) if isinstance(d, (list, tuple)) else [d]
                rows.append([1 + v for v in row] if self.plus_one else row)
        table = np.array([r * self.width if len(r) == 1 else r for r in rows], dtype=np.float64)
        return Drawn((), {"table": table})

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        out = {}
        for k in self.keys:
            x = data[k]
            table = values["table"].to(x.dtype)  # a python float against a float tensor: rounded to its dtype
            out[k] = self.op(x, table.view(*table.shape, *([1] * (x.ndim - 2)))).to(x.dtype)
        return out


def _float_keys(like: Like, keys: list[Hashable]) -> bool:
    import torch

    return all(like[k].dtype in (torch.float32, torch.float64) for k in keys)


def _flip(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
    return _Flip(t, keys, like)


def _rotate90(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
    from loaders.tail.tailbatch import spatial_batch_axes

    for k in keys:
        a, b = spatial_batch_axes(like[k].ndim - 1, t.spatial_axes)
        if like[k].shape[a] != like[k].shape[b]:
            return None  # odd turns change the item's shape
    return _Rotate90(t, keys, like)


def _scale(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
    if t.scaler.dtype is not None and any(like[k].dtype != _dtype(t.scaler.dtype) for k in keys):
        return None  # a dtype change on some items only: MONAI's items would leave in two dtypes
    return _Scalar(t, keys, like, t.scaler, "factor", operator.mul, 1.0, True)


def _shift(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
    from loaders.tail.intensity import _meta_key

    if any(_meta_key(t, k) in like for k in keys):
        return None  # offsets scaled by a meta factor
    return _Scalar(t, keys, like, t.shifter, "_offset", operator.add, 0.0, False)


def _fired(name: str) -> Callable[[Any, list[Hashable], Like], Plan | None]:
    """A plan maker of `loaders.tail.fired_plans`."""

    def make(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
        from loaders.tail import fired_plans

        maker: Callable[[Any, list[Hashable], Like], Plan | None] = getattr(fired_plans, name)
        return maker(t, keys, like)

    return make


def _drawn(name: str) -> Callable[[Any, list[Hashable], Like], Plan | None]:
    """A plan maker of `loaders.tail.drawn_plans`."""

    def make(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
        from loaders.tail import drawn_plans

        maker: Callable[[Any, list[Hashable], Like], Plan | None] = getattr(drawn_plans, name)
        return maker(t, keys, like)

    return make


def _affine(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
    from loaders.tail.affine import plan_affine

    return plan_affine(t, keys, like)


def _rotate(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
    from loaders.tail.sparse import plan_rotate

    return plan_rotate(t, keys, like)


class _Squeeze(Plan):
    """SqueezeDimd: each entry's singleton item dim removed (nothing drawn)."""

    def __init__(self, t: Any, keys: list[Hashable], dims: dict[Hashable, int]) -> None:
        super().__init__(t, keys)
        self.dims = dims

    def draw(self, n: int) -> Drawn:
        return Drawn((), {})

    def values_like(self, n: int) -> dict[str, Any]:
        return {}

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        return {k: data[k].squeeze(self.dims[k]) for k in self.keys}


def _squeeze(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
    dim, dims = t.converter.dim, {}
    if dim is None:
        return None
    for k in keys:
        item_ndim = like[k].ndim - 1
        d = dim + item_ndim if dim < 0 else dim
        if not 0 <= d < item_ndim or like[k].shape[d + 1] != 1:
            return None  # MONAI says so, item by item
        dims[k] = d + 1
    return _Squeeze(t, keys, dims)


def _elastic_3d(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
    from loaders.tail.elastic import plan_3d

    return plan_3d(t, keys, like)


def _dtype(dtype: Any) -> Any:
    import torch
    from monai.utils import get_equivalent_dtype

    return get_equivalent_dtype(dtype, torch.Tensor)


_PLANS: dict[str, Callable[[Any, list[Hashable], Like], Plan | None]] = {
    "Rand3DElasticd": _elastic_3d,
    "RandAffined": _affine,
    "RandRotated": _rotate,
    "SqueezeDimd": _squeeze,
    "RandAdjustContrastd": _fired("adjust_contrast"),
    "RandBiasFieldd": _fired("bias_field"),
    "RandHistogramShiftd": _fired("histogram_shift"),
    "RandStdShiftIntensityd": _fired("std_shift"),
    "RandGaussianSharpend": _drawn("plan_sharpen"),
    "RandCoarseDropoutd": _drawn("plan_dropout"),
    "RandFlipd": _flip,
    "RandRotate90d": _rotate90,
    "RandScaleIntensityd": _scale,
    "RandShiftIntensityd": _shift,
}


class Eager(Plan):
    """A transform with no plan run as the tail runs it otherwise (its batched version, else MONAI item by item),
    between the graphs: where it keeps every entry's shape and dtype (`EAGER`, float32 entries), so the buffers
    around it hold. Its draws are made as it runs; its host time is paid on the batches it fires on."""

    eager = True

    def draw(self, n: int) -> Drawn:
        return Drawn(("eager",), {})

    def values_like(self, n: int) -> dict[str, Any]:
        return {}

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        return {}  # the batch's shapes after it: as before


# MONAI transforms that leave a float32 entry's shape and dtype as they are (run eagerly between graphs)
EAGER = frozenset({
    "RandAdjustContrastd", "RandBiasFieldd", "RandCoarseDropoutd", "RandGaussianNoised", "RandGaussianSharpend",
    "RandGaussianSmoothd", "RandHistogramShiftd", "RandStdShiftIntensityd",
})  # fmt: skip


def planned_names() -> list[str]:
    """The MONAI transforms with a plan (for some inputs: `plan_of` says for which)."""
    return sorted(_PLANS)


def plan_of(t: Any, like: Like) -> Plan | None:
    """The plan of MONAI transform `t` for a batch like `like` (every entry it acts on a float32/float64 tensor of
    the batch), or None."""
    import torch

    cls = type(t)
    if not cls.__module__.startswith("monai.transforms.") or cls.__name__ not in _PLANS.keys() | EAGER:
        return None
    try:
        keys = list(t.key_iterator(like))
    except KeyError:  # an entry it acts on is not among the batch's on its device
        return None
    if not keys or not _float_keys(like, keys) or any(like[k].ndim < 3 for k in keys):
        return None
    planned = _PLANS[cls.__name__](t, keys, like) if cls.__name__ in _PLANS else None
    if planned is None and cls.__name__ in EAGER and all(like[k].dtype == torch.float32 for k in keys):
        return Eager(t, keys)
    return planned
