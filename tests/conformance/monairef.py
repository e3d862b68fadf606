"""MONAI itself as the reference: the head from the source files, then `Compose(tail, <the user's options>)`
seeded as the row's user seeds it, item by item in the order a loader reports, then `list_data_collate`."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch


@contextlib.contextmanager
def seeded(row: Any, seed: int) -> Iterator[Any]:
    """A fresh full transform seeded the row's way; "loader" seeding is applied to the loader by the caller."""
    from monai.utils import set_determinism

    if row.seeding == "determinism":
        set_determinism(seed)
    try:
        transform = row.chain()
        if row.seeding == "transform":
            transform.set_random_state(seed)
        yield transform
    finally:
        if row.seeding == "determinism":
            set_determinism(None)


def tail_of(row: Any, seed: int) -> Any:
    """MONAI's tail Compose for this row, with the user's Compose options, seeded as the user seeds it."""
    from monai.transforms import Compose
    from monai.utils import set_determinism

    if row.seeding == "determinism":
        set_determinism(seed)  # Compose seeds itself from it when built
        try:
            return Compose(row.tail(), **row.compose)
        finally:
            set_determinism(None)
    tail = Compose(row.tail(), **row.compose)
    # seeded as `transform.set_random_state(seed)` seeds the whole chain: a Compose nested in the head is
    # random (Randomizable) and takes a seed of its own before the tail's transforms get theirs
    Compose([*row.head(), *tail.transforms]).set_random_state(seed)
    return tail


class Reference:
    """MONAI's batches for a sequence of loader batches: it follows each batch's `_items`."""

    def __init__(self, row: Any, data: list[dict[str, Any]], seed: int) -> None:
        from monai.transforms import Compose

        self.head = Compose(row.head(), **row.compose)
        self.tail = tail_of(row, seed)
        self.data = data

    def item(self, i: int) -> list[dict[str, Any]]:
        out = self.tail(self.head(copy.deepcopy(self.data[i])))
        return out if isinstance(out, list) else [out]

    def batch(self, items: list[int]) -> dict[str, Any]:
        """MONAI's collated batch for the loader's `_items` (an item with num_samples outputs repeats)."""
        from monai.data import list_data_collate

        outs: list[dict[str, Any]] = []
        at = 0
        while at < len(items):
            got = self.item(items[at])
            outs += got
            assert items[at : at + len(got)] == [items[at]] * len(got), ("outputs per item", items, at)
            at += len(got)
        return list_data_collate(outs)  # type: ignore[no-any-return]


def plain(value: Any) -> Any:
    return value.as_tensor() if hasattr(value, "as_tensor") else value


def assert_batch_equal(
    got: dict[str, Any], want: dict[str, Any], atol: float = 0.0, where: str = "", meta: bool = True
) -> None:
    """Same keys (less the loader's `_items`), Python types (MetaTensor or Tensor, str or MONAI's enums, ...),
    dtypes, shapes and values (bit for bit unless atol); a list of batches (MONAI's after two multi-sample crops)
    batch by batch. meta=False: a MetaTensor of `want` may come as a plain Tensor (PreparedLoader's output is
    plain tensors, docs/loaders.md); every other type must still match."""
    if isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, type(got))
        for j, (g, w) in enumerate(zip(got, want)):
            assert_batch_equal(g, w, atol, f"{where}[{j}]", meta)
        return
    keys = set(want)
    assert set(got) - {"_items"} == keys, (where, sorted(map(str, got)), sorted(map(str, keys)))
    for k in sorted(keys, key=str):
        _assert_equal(got[k], want[k], atol, f"{where} {k}", meta)


def _same_type(g: Any, w: Any, meta: bool, where: str) -> None:
    if not meta and isinstance(w, torch.Tensor) and type(g) is torch.Tensor:
        return
    assert type(g) is type(w), (where, type(g), type(w))


def _assert_equal(g: Any, w: Any, atol: float, where: str, meta: bool = True) -> None:
    """Tensors as above; dicts (a collated meta dict) and lists entry by entry; anything else by == (types first)."""
    _same_type(g, w, meta, where)
    g, w = plain(g), plain(w)
    if isinstance(w, torch.Tensor):
        g = g.cpu()
        assert g.dtype == w.dtype and g.shape == w.shape, (where, g.dtype, w.dtype, g.shape, w.shape)
        if atol == 0.0:
            assert torch.equal(g, w) or (g.is_floating_point() and torch.equal(g.nan_to_num(), w.nan_to_num())), (
                where, (g.double() - w.double()).abs().max().item())  # fmt: skip
        else:
            torch.testing.assert_close(g.double(), w.double(), atol=atol, rtol=0, msg=where)
    elif isinstance(w, dict):
        assert set(g) == set(w), (where, sorted(map(str, g)), sorted(map(str, w)))
        for k in w:
            _assert_equal(g[k], w[k], atol, f"{where}/{k}", meta)
    elif isinstance(w, (list, tuple)):
        assert len(g) == len(w), (where, g, w)
        for j, (a, b) in enumerate(zip(g, w)):
            _assert_equal(a, b, atol, f"{where}[{j}]", meta)
    elif isinstance(w, np.ndarray):
        assert g.dtype == w.dtype and np.array_equal(g, w, equal_nan=g.dtype.kind in "fc"), (where, g, w)
    else:
        assert g == w, (where, g, w)


def differs(got: dict[str, Any], want: dict[str, Any]) -> bool:
    return any(
        isinstance(plain(want[k]), torch.Tensor)
        and (plain(got[k]).shape != plain(want[k]).shape or not torch.equal(plain(got[k]).cpu(), plain(want[k])))
        for k in want
    )
