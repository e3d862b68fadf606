"""The batch between the tail's transforms (`TailBatch`: tensors of one leading dim, values passed through, items
set back where a transform ran per item) and the helpers the batched versions share: keys, dims, stacks."""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from loaders.errors import PrepError


def _plain(value: Any) -> Any:
    """A MetaTensor as a plain tensor (its meta is dropped: the batched ops never read it)."""
    import torch

    if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor:
        return value.as_subclass(torch.Tensor)
    return value


@dataclass
class TailBatch:
    """The batch between transforms: `data` holds tensors of leading dim `n` (and passed-through values).

    When items stop having equal shapes (a random-size crop), `items` holds one dict per item instead and
    the following transforms run per item until the shapes agree again.
    """

    data: dict[Hashable, Any]
    n: int
    items: list[dict[Hashable, Any]] | None = None
    per_item: set[Hashable] = field(default_factory=set)  # passed-through lists with one entry per item
    inputs: set[int] = field(default_factory=set)  # storages of the caller's tensors (never written)
    origin: list[int] = field(default_factory=list)  # the input item each current item came from
    groups: list[int] = field(default_factory=list)  # the MONAI item each current item is a sample of
    # (a device flag, what MONAI raises where it is false): values the host would read mid-tail to raise as MONAI
    # does, read once after the whole tail (`BatchedTail.run`), so its kernels are not split by a wait
    checks: list[tuple[Any, BaseException]] = field(default_factory=list)

    @classmethod
    def from_batch(cls, batch: Mapping[Any, Any], device: Any = None, groups: Sequence[int] | None = None) -> TailBatch:
        import torch

        data = {k: _plain(v) for k, v in batch.items()}
        tensors = [v for v in data.values() if isinstance(v, torch.Tensor) and v.ndim > 1]
        if not tensors:
            raise PrepError("BatchedTail: the batch holds no (B, C, *spatial) tensor; pass a collated batch")
        n = int(tensors[0].shape[0])
        if device is not None:
            data = {k: v.to(device, non_blocking=True) if cls._batched(v, n) else v for k, v in data.items()}
        per_item = {k for k, v in data.items() if isinstance(v, (list, tuple)) and len(v) == n}
        inputs = {v.untyped_storage().data_ptr() for v in data.values() if isinstance(v, torch.Tensor)}
        groups = list(groups) if groups is not None else list(range(n))
        return cls(data=data, n=n, per_item=per_item, inputs=inputs, origin=list(range(n)), groups=groups)

    @staticmethod
    def _batched(value: Any, n: int) -> bool:
        import torch

        return isinstance(value, torch.Tensor) and value.ndim >= 1 and int(value.shape[0]) == n

    def is_batched(self, key: Hashable) -> bool:
        """Whether `key` holds a tensor with one entry per item."""
        return self.items is None and self._batched(self.data.get(key), self.n)

    def item(self, i: int) -> dict[Hashable, Any]:
        """Item `i` as MONAI's per-item chain sees it: views of the batch, copies where they would view the
        caller's tensors (a MONAI transform may write in place; the caller's batch is never changed)."""
        if self.items is not None:
            return {k: self._own(v) for k, v in self.items[i].items()}
        out = {}
        for k, v in self.data.items():
            out[k] = self._own(v[i]) if self._batched(v, self.n) or k in self.per_item else v
        return out

    def subset(self, rows: Sequence[int]) -> TailBatch:
        """The batch of rows `rows` alone, its tensors copied (a transform given some of the items)."""
        data: dict[Hashable, Any] = {}
        for k, v in self.data.items():
            if self._batched(v, self.n):
                data[k] = gather(v, [v[i] for i in rows])
            else:
                data[k] = [v[i] for i in rows] if k in self.per_item else v
        origin, groups = [self.origin[i] for i in rows], [self.groups[i] for i in rows]
        return TailBatch(data=data, n=len(rows), per_item=set(self.per_item), inputs=set(), origin=origin,
                         groups=groups, checks=self.checks)  # fmt: skip

    def _own(self, value: Any) -> Any:
        import torch

        if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in self.inputs:
            return value.clone()
        return value

    def replace(self, new: Mapping[Hashable, Sequence[Any]], sources: Sequence[int]) -> None:
        """New per-item tensors for the keys in `new` (one per output item); output item j came from input
        item `sources[j]`, so every other per-item value is gathered from there (multi-sample crops)."""

        n_out = len(sources)
        self.origin = [self.origin[s] for s in sources]
        self.groups = [self.groups[s] for s in sources]
        identity = list(sources) == list(range(self.n))
        rest: dict[Hashable, Any] = {}
        for k, v in self.data.items():
            if k in new:
                continue
            if self._batched(v, self.n):
                rest[k] = v if identity else gather(v, [v[s] for s in sources])
            elif k in self.per_item:
                rest[k] = v if identity else [v[s] for s in sources]
            else:
                rest[k] = v
        stacked = {k: _stack(list(vals)) for k, vals in new.items()}
        self.n = n_out
        if all(s is not None for s in stacked.values()):
            self.data = {k: stacked[k] if k in new else rest[k] for k in self._order(new, rest)}
            return
        # ragged: keep one dict per item
        keys = self._order(new, rest)
        self.items = [
            {k: new[k][j] if k in new else (rest[k][j] if self._per(rest[k], k) else rest[k]) for k in keys}
            for j in range(n_out)
        ]
        self.data = {}

    def _order(self, new: Mapping[Hashable, Any], rest: Mapping[Hashable, Any]) -> list[Hashable]:
        keys = [k for k in self.data if k in new or k in rest]
        return keys + [k for k in new if k not in keys]

    def _per(self, value: Any, key: Hashable) -> bool:
        return self._batched(value, self.n) or key in self.per_item

    def set_items(self, items: list[dict[Hashable, Any]], sources: Sequence[int]) -> None:
        """The per-item outputs of a MONAI transform (output j from input item `sources[j]`): stacked again
        where shapes and dtypes agree."""
        self.origin = [self.origin[s] for s in sources]
        self.groups = [self.groups[s] for s in sources]
        self.items, self.n = [{k: _plain(v) for k, v in it.items()} for it in items], len(items)
        self.data = {}
        self.try_stack()

    def try_stack(self, promote: bool = False) -> None:
        """Leave ragged mode if every per-item tensor now has one shape and (unless `promote`) one dtype: items
        MONAI left in their own dtype (a transform with prob < 1 and dtype=) compute in it until collated."""
        import torch

        if self.items is None:
            return
        items = self.items
        keys = list(items[0]) if items else []
        data: dict[Hashable, Any] = {}
        per_item: set[Hashable] = set()
        for k in keys:
            vals = [it.get(k) for it in items]
            if all(isinstance(v, torch.Tensor) for v in vals):
                stacked = _stack(vals, promote)
                if stacked is None:
                    return
                data[k] = stacked
            elif k not in self.per_item and all(v is vals[0] for v in vals):
                data[k] = vals[0]
            else:
                data[k] = vals
                per_item.add(k)
        self.data, self.items, self.per_item = data, None, per_item

    def result(self) -> dict[Hashable, Any]:
        """The batch as a dict of stacked tensors (dtypes promoted, as MONAI's collate does); ragged items raise,
        as MONAI's collate would."""
        self.try_stack(promote=True)
        if self.items is not None:
            raise ragged_error(
                sorted({tuple(v.shape) for it in self.items for v in it.values() if hasattr(v, "shape")})
            )
        out = dict(self.data)
        for k, v in out.items():  # one list every item holds, as long as the batch: given once per item, so that
            if k not in self.per_item and isinstance(v, (list, tuple)) and len(v) == self.n:  # it is not read as
                out[k] = [v] * self.n  # one value per item (MONAI collates each item's whole list)
        return out


def ragged_error(shapes: Sequence[tuple[int, ...]]) -> PrepError:
    """The one-line refusal of a batch whose items' shapes differ after the tail (MONAI's collate raises)."""
    return PrepError(
        f"the items' shapes differ after the tail ({list(shapes)[:4]}), so they cannot be stacked (MONAI's "
        "list_data_collate fails too): use a fixed-size crop (random_size=False) or end the tail with a resize"
    )


def _stack(values: list[Any], promote: bool = True) -> Any:
    """torch.stack of equal-shaped tensors (dtype promoted as MONAI's collate would see it), else None; None
    also for unequal dtypes unless `promote`."""
    import torch

    if not values or any(tuple(v.shape) != tuple(values[0].shape) for v in values):
        return None
    if not promote and any(v.dtype != values[0].dtype for v in values):
        return None
    dtype = values[0].dtype
    for v in values[1:]:
        dtype = torch.promote_types(dtype, v.dtype)
    return torch.stack([_plain(v).to(dtype) for v in values])


def gather(x: Any, rows: Sequence[Any]) -> Any:
    """One tensor from per-item rows (views or tensors), by one stack: no index tensor to upload."""
    import torch

    return torch.stack(list(rows))


def item_rows(groups: Sequence[int] | None, n: int) -> list[list[int]]:
    """The rows of each MONAI item, in order of their first row (one row each without `groups`)."""
    if groups is None:
        return [[i] for i in range(n)]
    rows: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        rows.setdefault(g, []).append(i)
    return list(rows.values())


def keys_of(transform: Any, batch: TailBatch) -> list[Hashable]:
    """The keys a MONAI MapTransform acts on in this batch (missing keys skipped where it allows them)."""
    return list(transform.key_iterator(batch.data))


def batch_dim(dim: int) -> int:
    """An item's dim as the batch's (the batch dim comes first; a dim counted from the end stays as it is)."""
    return dim + 1 if dim >= 0 else dim


def spatial_batch_axes(item_ndim: int, axes: int | Sequence[int] | None) -> list[int]:
    """MONAI's spatial axes of an item (C, *spatial) as axes of the batch (N, C, *spatial)."""
    from monai.transforms.utils import map_spatial_axes

    return [batch_dim(a) for a in map_spatial_axes(item_ndim, axes)]
