"""`OneOf` over a batch: each MONAI item's choice drawn as MONAI draws it, each chosen transform batched over the
items that chose it.

MONAI's `OneOf` draws one index per item from its own generator (`R.multinomial(1, weights)`) and applies that
transform to the item (from MONAI 1.5, to all of an item's samples at once; before, to each sample on its own).
Every transform draws from a generator of its own, so the order between the OneOf's draws and a chosen
transform's does not change any number: the choices are drawn for the whole batch in item order, then each chosen
transform's batched version runs over its items, in item order (its draws as MONAI's per-item chain makes them),
and the rows go back in place. Where a chosen transform has no batched version, or changes the items' number or
keys, every draw is put back and the `OneOf` runs per item through MONAI.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from loaders.tail.batched import _handler, _monai_items
from loaders.tail.sparse import assemble, taken
from loaders.tail.tailbatch import TailBatch


def one_of(t: Any, batch: TailBatch) -> bool:
    """OneOf: the items' choices, then each chosen transform batched over its items (None of this where one
    cannot be: False, nothing drawn)."""
    from loaders.state import snapshot

    children = list(t.transforms)
    if not children:
        return True  # MONAI returns the data without drawing
    handlers = [_handler(c) for c in children]
    lazy = getattr(t, "lazy", False)
    if any(h is None for h in handlers) or lazy not in (False, None) or t.unpack_items or t.map_items not in (True, 1):
        return False
    if len({id(c) for c in children}) < len(children):
        return False  # one object twice: its draws would follow the item order across both uses
    keys = [k for k in batch.data if batch.is_batched(k)]
    restore = snapshot(t)
    chosen: dict[int, list[int]] = {}
    for rows in _monai_items(t, batch):
        chosen.setdefault(int(t.R.multinomial(1, t.weights).argmax()), []).extend(rows)
    outs: dict[int, dict[Hashable, Any]] = {}
    for j, rows in sorted(chosen.items()):
        rows.sort()
        sub, handler = batch.subset(rows), handlers[j]
        if handler is None or not handler(children[j], sub) or not _same_rows(sub, len(rows), keys):
            restore()
            return False
        for at, r in enumerate(rows):
            outs[r] = {k: sub.data[k][at] for k in keys}
    assemble(batch, keys, {r: taken(out) for r, out in outs.items()}, lambda x: x)
    return True


def _same_rows(sub: TailBatch, n: int, keys: list[Hashable]) -> bool:
    """Whether a chosen transform left its items one for one, stacked, with the same batched keys."""
    return sub.items is None and sub.n == n and [k for k in sub.data if sub.is_batched(k)] == keys
