"""The loader's tail: the tail's transforms after the folded crop, built into one MONAI `Compose` with the
user's Compose options (their random states kept by the caller, `loaders.state.keep_random_states`) and run
over a batch either batched (`loaders.tail.BatchedTail`) or through MONAI item by item (`PerItemTail`: items
of unequal shapes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from loaders.cache.nesting import flat_again, nested
from loaders.reading.staging import stack

__all__ = ["PerItemTail", "loader_tails"]


class PerItemTail:
    """The tail through MONAI, item by item (items of unequal shapes). compose: a MONAI Compose, or None
    (nothing after the folded crop)."""

    def __init__(self, compose: Any) -> None:
        self.compose = compose

    def run(self, batch: dict[str, Any], groups: Sequence[int] | None = None) -> tuple[dict[str, Any], list[int]]:
        """(the batch through the tail, the input item each output came from). `groups`: the MONAI item each
        row is a sample of (a folded multi-sample crop): its samples go through the tail as the list MONAI's
        chain hands on after such a crop."""
        from loaders.tail.tailbatch import item_rows, ragged_error

        keys = [k for k in batch if not k.startswith("_")]
        n = len(batch[keys[0]])
        if self.compose is None and not any(isinstance(batch[k], list) for k in keys):
            return {k: _plain(batch[k]) for k in keys}, list(range(n))  # stacked already: nothing to run or restack
        if self.compose is None:
            outs: list[dict[str, Any]] = [{k: batch[k][i] for k in keys} for i in range(n)]
            sources = list(range(n))
        else:
            outs, sources = [], []
            for rows in item_rows(groups, n):
                # the head's nested outputs (ClassesToIndicesd's index list, cached as "key/0", "key/1", ...)
                # reach MONAI as it made them, and its outputs are flat again for the batch
                given = [nested({k: batch[k][i] for k in keys}) for i in rows]
                out = self.compose([g for g, _ in given] if len(rows) > 1 else given[0][0])
                out = out if isinstance(out, list) else [out]  # num_samples crops: MONAI's list layout
                outs.extend(flat_again(o, given[0][1]) for o in out)
                sources.extend(rows if len(out) == len(rows) else [rows[0]] * len(out))
        result = {k: stack([_plain(o[k]) for o in outs]) for k in outs[0]}
        shapes = {tuple(t.shape) for v in result.values() if isinstance(v, list) for t in v if hasattr(t, "shape")}
        ragged = sorted(shapes)
        if ragged:  # MONAI's list_data_collate raises here too
            raise ragged_error(ragged)
        return result, sources


def _plain(t: Any) -> Any:
    return t.as_tensor() if hasattr(t, "as_tensor") else t


def loader_tails(transforms: Sequence[Any], device: Any, options: dict[str, Any] | None = None) -> tuple[Any, Any]:
    """(the batched tail, the per-item tail) of `transforms`: one Compose with the user's options, run by
    `loaders.tail.BatchedTail` on `device` or by MONAI per item."""
    if not transforms:
        return PerItemTail(None), PerItemTail(None)
    from monai.transforms import Compose

    from loaders.tail import BatchedTail

    compose = Compose(list(transforms), **(options or {}))
    return BatchedTail(compose, device=device), PerItemTail(compose)
