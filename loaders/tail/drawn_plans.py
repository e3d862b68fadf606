"""Plans (`loaders.tail.plans`) for `RandGaussianSharpend` and `RandCoarseDropoutd`, whose work's shapes follow the
draws (a sharpening kernel's length by its sigma, a hole's place and size).

Their draws need no image: they are made where the batch's other draws are (MONAI's own `randomize`, item by item,
in the order `loaders.tail.fired` draws them, a random fill's numbers included), so a tail with them can be drawn in
one process and worked in another (`BatchedTail.drawable`: a host feeder). Where the shapes come in a few kinds
(MONAI's "erf" kernels, whose lengths follow the sigmas' ranges; holes of one size, as many each time), the work runs
item by item as graphs, one a kind, the places and numbers copied up to them; otherwise it runs eagerly between the
graphs, with the ops the batched versions run (`loaders.tail.sharpen`, `loaders.tail.dropout`), at the cost of its
Python on the items they fire on.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from loaders.tail.plans import Drawn, Like, Plan


class _Ungraphed(Plan):
    """A plan run eagerly from its draws wherever it runs (`graphed` False); its draws' values are Python objects and
    numpy arrays (`values["items"]`: per item, None where it is left as it is), not copied up as a graph's are."""

    graphed = False

    def values_like(self, n: int) -> dict[str, Any]:
        return {}

    def _items(self, values: dict[str, Any]) -> list[Any]:
        return list(values.get("items") or [])


class _SharpenPlan(_Ungraphed):
    def __init__(self, t: Any, keys: list[Hashable], inner: Any) -> None:
        super().__init__(t, keys)
        self.inner = inner

    def draw(self, n: int) -> Drawn:
        from loaders.tail.fired import _drawn
        from loaders.tail.fired_plans import _fire

        def drawn() -> dict[str, Any]:
            self.inner.randomize(None)
            return _drawn(self.inner)

        return Drawn(("ungraphed",), {"items": _fire(self.t, self.inner, n, drawn)})

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        from loaders.tail.sharpen import filter_kernels, sharpened

        items = self._items(values)
        applied = [i for i, d in enumerate(items) if d is not None]
        first = data[self.keys[0]]
        if not applied or first.device.type == "meta":
            return {}
        out = {k: data[k].clone() for k in self.keys}
        made: dict[int, list[list[Any]]] = {}  # an item's ndim -> each applied item's kernels
        for k in self.keys:
            x = data[k]
            nd = x.ndim - 2
            if nd not in made:
                made[nd] = filter_kernels(self.inner.approx, [items[i] for i in applied], nd, x.device)
            for j, i in enumerate(applied):
                vars(self.inner).update(items[i])
                out[k][i] = sharpened(self.inner, x[i], made[nd][j])
        return out


class _SharpenItems(Plan):
    """RandGaussianSharpend with MONAI's "erf" kernels, item by item, in two parts: this one, each fired item's first
    filtering, and `_SharpenSecond`, its second filtering and sum. Each part's graphs are one for each set of its
    own filter's kernels' lengths (which follow the sigmas' ranges: a few kinds a part, where one graph for both
    filters' lengths would have their product), the sigmas and weight copied up to them; the items it skips left as
    they are (`AS_IS`: nothing launched)."""

    per_item = True

    def __init__(self, t: Any, keys: list[Hashable], inner: Any, nd: int) -> None:
        super().__init__(t, keys)
        self.inner, self.nd = inner, nd
        self.second = _SharpenSecond(t, keys)

    def parts(self) -> list[Plan]:
        return [self, self.second]

    def draw_all(self, n: int) -> list[Any]:
        from loaders.tail import gauss
        from loaders.tail.fired import _drawn
        from loaders.tail.fired_plans import _fire
        from loaders.tail.plans import AS_IS
        from loaders.tail.sharpen import TRUNCATED, sigmas_of

        def drawn() -> dict[str, Any]:
            self.inner.randomize(None)
            return _drawn(self.inner)

        first, second = [], []
        for d in _fire(self.t, self.inner, n, drawn):
            if d is None:
                first.append(Drawn(AS_IS, {}))
                second.append(Drawn(AS_IS, {}))
                continue
            sigmas = np.array([float(s) for s in sigmas_of(d, self.nd)], dtype=np.float32)  # the filters' float32
            tails = tuple(gauss.tail_of(float(s), TRUNCATED) for s in sigmas)
            nd = self.nd
            first.append(Drawn(("blurred", tails[:nd]), {"sigmas": sigmas[:nd]}))
            second.append(Drawn(("sharpened", tails[nd:]), {"sigmas": sigmas[nd:],
                                                           "a": np.array([d["a"]], dtype=np.float32)}))  # fmt: skip
        return [first, second]

    def values_like(self, n: int) -> dict[str, Any]:
        return {}

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        from loaders.tail.sharpen import blurred_with

        if _left(data, self.keys, kind, "blurred"):
            return {k: data[k] for k in self.keys}
        kernels = _kernels(values["sigmas"], kind[1])
        return {k: blurred_with(data[k], kernels) for k in self.keys}


class _SharpenSecond(Plan):
    """`_SharpenItems`' second part: a fired item's second filtering and the sharpening's sum, from its first
    filtering's output (drawn with the first part: `follows`)."""

    per_item = True
    follows = True

    def values_like(self, n: int) -> dict[str, Any]:
        return {}

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        from loaders.tail.sharpen import sharpened_from

        if _left(data, self.keys, kind, "sharpened"):
            return {k: data[k] for k in self.keys}
        kernels = _kernels(values["sigmas"], kind[1])
        return {k: sharpened_from(data[k], kernels, values["a"]) for k in self.keys}


def _kernels(sigmas: Any, tails: tuple[int, ...]) -> list[Any]:
    """One filter's "erf" kernels for its sigmas (a float32 tensor) and their half lengths, made where the sigmas are
    (`loaders.tail.gauss`: on a CUDA device with no host read)."""
    from loaders.tail import gauss
    from loaders.tail.sharpen import TRUNCATED

    if sigmas.is_cuda:
        return gauss._erf_rows(sigmas, list(tails), TRUNCATED)
    return [gauss.kernel(sigmas[j : j + 1], t, TRUNCATED) for j, t in enumerate(tails)]


class _DropoutPlan(_Ungraphed):
    """Each fired item's holes and, for a random fill, its numbers (numpy's `random_sample` where the fill spans
    the item's own range: `loaders.tail.dropout.uniform_is_affine`; `uniform` over a range given), key by key and
    hole by hole as the batched version draws them."""

    def __init__(self, t: Any, keys: list[Hashable], inner: Any, item_shape: tuple[int, ...]) -> None:
        super().__init__(t, keys)
        self.inner, self.item_shape = inner, item_shape

    def draw(self, n: int) -> Drawn:
        from loaders.tail.fired_plans import _fire

        return Drawn(("ungraphed",), {"items": _fire(self.t, self.inner, n, self._one)})

    def _one(self) -> dict[str, Any] | None:
        """A fired item's holes and fills (None where the inner transform does not fire: no fill drawn either)."""
        inner = self.inner
        inner.randomize(self.item_shape[1:])
        if not inner._do_transform:
            return None
        holes = list(inner.hole_coords)
        fills: dict[Hashable, list[np.ndarray]] = {}
        if isinstance(inner.fill_value, (tuple, list)) or inner.fill_value is None:
            sizes = [self.item_shape] if not inner.dropout_holes else [_shape(self.item_shape, h) for h in holes]
            for k in self.keys:
                fills[k] = [self._numbers(size) for size in sizes]
        return {"hole_coords": holes, "fills": fills}

    def _numbers(self, size: tuple[int, ...]) -> np.ndarray:
        fill = self.inner.fill_value
        if fill is None:
            return np.asarray(self.inner.R.random_sample(size))
        return np.asarray(self.inner.R.uniform(fill[0], fill[1], size=size))

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        import torch

        from loaders.tail.device import row_spans
        from loaders.tail.dropout import RANGE_ERROR, _up, holes_filled

        items = self._items(values)
        fired = [i for i, d in enumerate(items) if d is not None]
        first = data[self.keys[0]]
        if not fired or first.device.type == "meta":
            return {}
        out = {k: data[k].clone() for k in self.keys}
        for k in self.keys:
            x = data[k]
            spans = row_spans(x) if self.inner.fill_value is None else None  # each item's own range
            for i in fired:
                img = x[i]
                fills = [_up(u, img) for u in items[i]["fills"].get(k, [])]
                if spans is not None:
                    lo, width = spans[i, 0], spans[i, 1] - spans[i, 0]
                    self.checks.append((torch.isfinite(width), OverflowError(RANGE_ERROR)))
                    fills = [u.mul(width).add_(lo) for u in fills]
                self.inner.hole_coords = items[i]["hole_coords"]
                out[k][i] = holes_filled(self.inner, img, _in_turn(fills) if fills else None)
        return out


class _DropoutItems(_DropoutPlan):
    """RandCoarseDropoutd's holes (of one size, filled inside) item by item: each fired item's hole corners and fill
    numbers copied up to a graph for its holes' shapes, which writes them as `holes_filled` does (a random fill over
    the item's range made there, in float64, its range's check a device flag); the items it skips left as they are."""

    per_item = True
    graphed = True

    def draw_items(self, n: int) -> list[Drawn]:
        from loaders.tail.fired_plans import _fire
        from loaders.tail.plans import AS_IS

        out = []
        for d in _fire(self.t, self.inner, n, self._one):
            if d is None:
                out.append(Drawn(AS_IS, {}))
                continue
            holes = d["hole_coords"]
            shapes = tuple(_shape(self.item_shape, h) for h in holes)
            values: dict[str, Any] = {"starts": np.array([_corner(h) for h in holes], dtype=np.int64)}
            for j, k in enumerate(self.keys):
                if d["fills"].get(k):
                    values[f"fill{j}"] = np.concatenate([np.asarray(f, dtype=np.float64).reshape(-1)
                                                         for f in d["fills"][k]])  # fmt: skip
            out.append(Drawn(("holes", shapes), values))
        return out

    def apply(self, data: dict[Hashable, Any], values: dict[str, Any], kind: Any = ()) -> dict[Hashable, Any]:
        import torch

        from loaders.tail.device import row_spans
        from loaders.tail.dropout import RANGE_ERROR

        if _left(data, self.keys, kind, "holes"):
            return {k: data[k] for k in self.keys}
        out = {}
        for j, k in enumerate(self.keys):
            x = data[k]
            o = x.clone(memory_format=torch.contiguous_format)  # the flat indices below are a contiguous item's
            flat = o.view(-1)
            fills = values.get(f"fill{j}")
            if fills is not None and self.inner.fill_value is None:  # over the item's own range, made here
                span = row_spans(x)[0]
                lo, width = span[0], span[1] - span[0]
                self.checks.append((torch.isfinite(width), OverflowError(RANGE_ERROR)))
                fills = fills.mul(width).add_(lo)
            at = 0
            for h, shape in enumerate(kind[1]):
                index = _hole_index(shape, tuple(x.shape[1:]), values["starts"][h])
                if fills is None:
                    flat.index_fill_(0, index, self.inner.fill_value)
                else:
                    flat.index_copy_(0, index, fills[at : at + index.numel()].to(o.dtype))
                    at += index.numel()
            out[k] = o
        return out


def _left(data: dict[Hashable, Any], keys: list[Hashable], kind: Any, tag: str) -> bool:
    """Whether an item-by-item plan leaves the item as it is: shapes alone (meta), or a kind other than its work's
    (`AS_IS`, an item it skips)."""
    return data[keys[0]].device.type == "meta" or not (isinstance(kind, tuple) and kind[:1] == (tag,))


def _corner(hole: Any) -> list[int]:
    """A hole's first index along each spatial axis (its slices' starts: MONAI's holes are whole-channel boxes)."""
    if hole[0] != slice(None) or any(s.step not in (None, 1) or s.start is None for s in hole[1:]):
        raise ValueError(f"RandCoarseDropoutd drew a hole {hole!r} that is not a box; run it with "
                         "BLOCKPREP_ITEMS_GRAPHED=0 and report it")  # fmt: skip
    return [int(s.start) for s in hole[1:]]


def _hole_index(shape: tuple[int, ...], item_shape: tuple[int, ...], corner: Any) -> Any:
    """The flat indices, in C order, of a hole of `shape` (channels first) at `corner` (a device vector of its
    spatial starts) in a contiguous item of `item_shape` (channels first)."""
    import torch

    strides = [int(np.prod(item_shape[d + 1 :])) for d in range(len(item_shape))]
    index = torch.zeros((), dtype=torch.int64, device=corner.device)
    for size, stride in zip(shape, strides):
        index = index.unsqueeze(-1) + torch.arange(size, dtype=torch.int64, device=corner.device) * stride
    offset = sum(corner[d] * strides[d + 1] for d in range(len(shape) - 1))
    return index.reshape(-1) + offset


def _in_turn(fills: list[Any]) -> Callable[[tuple[int, ...]], Any]:
    """A fill of the sizes drawn, hole after hole: the numbers drawn for each, in turn."""
    given = iter(fills)

    def uniform(size: tuple[int, ...]) -> Any:
        return next(given)

    return uniform


def _shape(item_shape: tuple[int, ...], hole: Any) -> tuple[int, ...]:
    """The shape of `item[hole]` for an item of `item_shape` (nothing allocated)."""
    return tuple(np.broadcast_to(np.empty((), dtype=np.bool_), item_shape)[hole].shape)


def plan_sharpen(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
    import torch

    from loaders import tunables

    inner = getattr(t, "rand_sharpen", None)
    if inner is None or getattr(t, "lazy", False) is not False:
        return None
    if any(like[k].dtype != torch.float32 for k in keys):
        return None  # MONAI's output is float32: a float64 key's fired items would change dtype
    dims = {like[k].ndim - 2 for k in keys}
    if str(inner.approx).lower() == "erf" and len(dims) == 1 and tunables.ITEMS_GRAPHED:
        return _SharpenItems(t, keys, inner, dims.pop())
    return _SharpenPlan(t, keys, inner)


def plan_dropout(t: Any, keys: list[Hashable], like: Like) -> Plan | None:
    from loaders import tunables
    from loaders.tail.dropout import uniform_is_affine

    inner = getattr(t, "dropper", None)
    if inner is None or getattr(t, "lazy", False) is not False:
        return None
    shapes = {tuple(like[k].shape[1:]) for k in keys}
    if len(shapes) != 1 or (inner.fill_value is None and not uniform_is_affine()):
        return None  # numpy's fill drawn from the item's range read on the host: run as the batched version runs it
    item_shape = shapes.pop()
    if tunables.ITEMS_GRAPHED and inner.dropout_holes and inner.max_spatial_size is None and inner.max_holes is None:
        return _DropoutItems(t, keys, inner, item_shape)  # holes of one size, as many each time: a few graphs
    return _DropoutPlan(t, keys, inner, item_shape)
