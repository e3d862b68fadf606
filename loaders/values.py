"""The head's non-tensor outputs (class labels, names, datalist entries) in a loader's batches: read from each
item's meta line and collated after the tail as MONAI's `list_data_collate` does."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loaders.errors import FormatError
from loaders.format import PreparedCache
from loaders.meta import line_values

__all__ = ["Values"]


class Values:
    """The non-tensor output keys (of `keys`, default all) that item 0's meta line holds, and each item's
    values of them. Refuses a `tail` transform that reads one: the loader batches them after the tail."""

    def __init__(self, cache: PreparedCache, keys: Sequence[str] | None, tail: Sequence[Any]) -> None:
        self.cache = cache
        self._keys_given = keys
        self.keys: list[str] = []
        self._items: dict[int, dict[str, Any]] = {}  # item -> its values
        if not len(cache):
            return
        names = [k for k in line_values(cache.meta(0)) if keys is None or k in keys]
        for t in tail:
            used = [k for k in names if k in (getattr(t, "keys", None) or ())]
            if used:
                raise ValueError(
                    f"PreparedLoader: tail transform {type(t).__name__} reads the non-tensor key(s) {used}, which the "
                    "loader batches after the tail; use PreparedPersistentDataset for this chain"
                )
        self.keys = names

    def collate(self, out: dict[str, Any]) -> dict[str, Any]:
        """`out` with each value key collated over its outputs' items (a multi-sample crop repeats its item's)."""
        if not self.keys:
            return out
        from monai.data.utils import list_data_collate

        out.update(list_data_collate([self._of(item) for item in out["_items"].tolist()]))
        return out

    def _of(self, item: int) -> dict[str, Any]:
        got = self._items.get(item)
        if got is None:
            values = line_values(self.cache.meta(item))
            got = self._items[item] = {k: values[k] for k in self.keys if k in values}
            names = {k for k in values if self._keys_given is None or k in self._keys_given}
            if names != set(self.keys):  # MONAI's collate would fail on a batch mixing such items
                raise FormatError(
                    f"{self.cache.root}: item {item}'s non-tensor outputs {sorted(names)} differ from item 0's "
                    f"{sorted(self.keys)}; give every item the same keys (the head's outputs, the datalist's "
                    "entries) and re-run `prep cache --force`"
                )
        return got
