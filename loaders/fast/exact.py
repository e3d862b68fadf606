"""What keeps PreparedLoader equal to MONAI on the user's chain: its Compose options, its seeding, and the
chains it refuses (one line naming the transform and what to do instead) rather than give other values.

Light at import: MONAI is imported inside the functions.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from loaders.errors import UnsupportedChainError

# Transforms that read an item's affine or meta (MONAI's MetaTensor): PreparedLoader's tail gets plain tensors.
META_READERS = frozenset(
    {"EnsureChannelFirstd", "Invertd", "Orientationd", "ResampleToMatchd", "SaveImaged", "Spacingd",
     "SpatialResampled"}
)  # fmt: skip


def _name(t: Any) -> str:
    return str(t.__name__) if inspect.isfunction(t) else type(t).__name__


def refuse_meta_readers(tail: Sequence[Any]) -> None:
    """UnsupportedChainError for a tail transform that needs the head's meta (the head ended before it)."""
    from monai.transforms import Transform

    for t in tail:
        if _name(t) in META_READERS:
            ender = _name(tail[0])
            fix = f"move {ender} after {_name(t)}"
            if not isinstance(tail[0], Transform):
                fix += " or make it a MONAI Transform (subclass monai.transforms.MapTransform)"
            raise UnsupportedChainError(
                f"PreparedLoader: {_name(t)} runs in the tail (the cached head ends at {ender}) on plain tensors "
                f"without the affine it needs; {fix}, or use PreparedPersistentDataset"
            )


def _samples(t: Any) -> int:
    """How many crops a transform makes of one item (`num_samples`, its own or its cropper's; 1 otherwise)."""
    for holder in (t, getattr(t, "cropper", None)):
        n = getattr(holder, "num_samples", None)
        if isinstance(n, int) and not isinstance(n, bool):
            return n
    return 1


def refuse_nested_samples(tail: Sequence[Any]) -> None:
    """UnsupportedChainError for two multi-sample crops in one tail: MONAI's per-item chain then makes lists of
    lists, and its collate a list of batches, one for each of the second crop's samples."""
    many = [t for t in _members(tail) if _samples(t) > 1]
    if len(many) > 1:
        a, b = many[0], many[1]
        raise UnsupportedChainError(
            f"PreparedLoader: two multi-sample crops in the tail ({_name(a)} with num_samples={_samples(a)}, then "
            f"{_name(b)} with num_samples={_samples(b)}): MONAI's batch is then a list of {_samples(b)} batches, "
            "which this loader does not make; use one crop with more samples, or PreparedPersistentDataset"
        )


def _members(tail: Sequence[Any]) -> list[Any]:
    """The tail's transforms, into Composes and their subclasses (OneOf, SomeOf, RandomOrder)."""
    from monai.transforms import Compose

    out: list[Any] = []
    for t in tail:
        out += _members(list(t.transforms)) if isinstance(t, Compose) else [t]
    return out


def tail_sees_values(names: Sequence[str], tail: Sequence[Any]) -> bool:
    """Whether the tail may read or change the head's non-tensor outputs (datalist values, class labels): a
    transform that names one (Lambdad, DeleteItemsd), keeps only the keys it names (SelectItemsd) or gets the
    whole dict (a plain function, Lambda). PreparedLoader then hands each row its item's values through the
    tail, as MONAI does; else it collates them after the tail (they cannot change)."""
    from monai.transforms import DeleteItemsd, MapTransform, SelectItemsd

    top = {str(n).split("/", 1)[0] for n in names}  # "tags/0", "tags/1": the list "tags"
    for t in _members(tail):
        if not isinstance(t, MapTransform) or isinstance(t, (SelectItemsd, DeleteItemsd)):
            return bool(top)
        if top & {str(k) for k in (getattr(t, "keys", None) or ())}:
            return bool(top)
    return False


def nested_batch(batch: dict[str, Any]) -> dict[str, Any]:
    """A batch whose "key/part" entries (a head's nested outputs, cached flat: the arrays of
    `LoadImaged(image_only=False)`'s meta dicts) are nested again as MONAI's collate nests them, merged with
    the collated values of the same dict (its scalars and strings, batched apart)."""
    from loaders.cache.nesting import unflatten

    parts = {k: v for k, v in batch.items() if isinstance(k, str) and "/" in k}
    if not parts:
        return batch
    out = {k: v for k, v in batch.items() if k not in parts}
    for key, tree in unflatten(parts).items():
        out[key] = _merged(out.get(key), tree)
    return out


def _merged(a: Any, b: Any) -> Any:
    if isinstance(a, dict) and isinstance(b, dict):
        return {**a, **{k: _merged(a.get(k), v) for k, v in b.items()}}
    return b if a is None else a


class Seeder:
    """Seeds the tail as `transform.set_random_state(seed)` would: the user's nesting decides which seed
    each random transform gets (a nested Compose draws its members' seeds from its own). Built without
    re-seeding: the user's own seeding (set_random_state before building, set_determinism) is kept."""

    def __init__(self, transform: Any) -> None:
        from monai.transforms import Compose

        from loaders.state import keep_random_states

        with keep_random_states(transform):
            self.compose = transform if isinstance(transform, Compose) else Compose(list(transform))

    def set_random_state(self, seed: int | None) -> None:
        self.compose.set_random_state(seed=seed)
