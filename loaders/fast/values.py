"""The head's non-tensor outputs (class labels, names, datalist entries) in a loader's batches: read from each
item's meta line and collated after the tail as MONAI's `list_data_collate` does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loaders.cache.format import PreparedCache
from loaders.cache.meta import line_values
from loaders.errors import FormatError

__all__ = ["Values"]


class Values:
    """The non-tensor output keys (of `keys`, default all) that item 0's meta line holds, and each item's
    values of them (a list value, cached as "tags/0", "tags/1", ..., as given). Where a `tail` transform may
    read or change them (`loaders.fast.exact.tail_sees_values`), each row gets its item's values through the tail,
    as MONAI gives them; else they are collated after the tail."""

    def __init__(self, cache: PreparedCache, keys: Sequence[str] | None, tail: Sequence[Any]) -> None:
        from loaders.fast.exact import tail_sees_values

        self.cache = cache
        self._keys_given = keys
        self.keys: list[str] = []
        self.in_tail = False
        self._items: dict[int, dict[str, Any]] = {}  # item -> its values
        if not len(cache):
            return
        names = [k for k in line_values(cache.meta(0)) if keys is None or k.split("/", 1)[0] in keys]
        self.in_tail = tail_sees_values(names, tail)
        self.keys = list(dict.fromkeys(k.split("/", 1)[0] for k in names))  # "tags/0", "tags/1": the list "tags"

    def into_tail(self, batch: dict[str, Any], items: Sequence[int]) -> None:
        """Each row's values put into the batch before the tail, where the tail sees them."""
        if self.in_tail:
            batch.update({k: [self.of(i)[k] for i in items] for k in self.keys})

    def collate(self, out: dict[str, Any]) -> dict[str, Any]:
        """`out` with its non-tensor entries collated as MONAI's list_data_collate collates them: what the tail
        gave (a list with one entry per output row, or one object every row shares: "CT" becomes ["CT", "CT"]),
        and the head's values (a multi-sample crop repeats its item's) unless the tail saw them."""
        import torch
        from monai.data.utils import list_data_collate

        n = len(out["_items"])
        loose = [k for k, v in out.items() if k != "_items" and not isinstance(v, torch.Tensor)]
        rows = [{k: out[k][j] if isinstance(out[k], list) and len(out[k]) == n else out[k] for k in loose}
                for j in range(n)]  # fmt: skip
        if self.keys and not self.in_tail:
            for row, item in zip(rows, out["_items"].tolist()):
                row.update(self.of(item))
        if rows and rows[0]:
            out.update(list_data_collate(rows))
        return out

    def of(self, item: int) -> dict[str, Any]:
        """Item `item`'s values (checked to have item 0's keys)."""
        from loaders.cache.nesting import nested

        got = self._items.get(item)
        if got is None:
            values, _ = nested(line_values(self.cache.meta(item)))  # a list value ("tags/0", ...) as given
            names = {k for k in values if self._keys_given is None or k in self._keys_given}
            if names != set(self.keys):  # MONAI's collate would fail on a batch mixing such items
                raise FormatError(
                    f"{self.cache.root}: item {item}'s non-tensor outputs {sorted(names)} differ from item 0's "
                    f"{sorted(self.keys)}; give every item the same keys (the head's outputs, the datalist's "
                    "entries) and re-run `prep cache --force`"
                )
            got = self._items[item] = {k: values[k] for k in self.keys}
        return got
