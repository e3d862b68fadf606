"""MONAI face: a drop-in for `PersistentDataset` that reads the deterministic head's output from a prepared
cache and applies the random tail at training time, exactly as MONAI's pipeline would.

A training script changes one line::

    ds = PersistentDataset(data, transform, cache_dir="pt_cache")          # before
    ds = PreparedPersistentDataset(data, transform, cache_dir="prepared")   # after (`prep cache` made it)

The cache must have been prepared with the same head: `loaders.chain.fingerprint` of this transform's head
must equal the manifest's "fingerprint", else StaleError says so.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from loaders import chain
from loaders._deps import require
from loaders.backends import Backend
from loaders.errors import StaleError
from loaders.format import MANIFEST, to_jsonable

# Compose options that change how transforms are applied; the tail keeps the user's settings.
_COMPOSE_OPTIONS = ("map_items", "unpack_items", "lazy", "overrides", "log_stats")
# MetaTensor meta keys that are not arrays although JSON stored them as lists
_LIST_META = ("applied_operations", "crop_center")


def restore_meta(tensor: Any, meta: Mapping[str, Any] | None) -> Any:
    """Wrap a tensor as a MONAI MetaTensor with its stored meta, types as LoadImage made them: affine a
    float64 tensor, original_affine and other numeric lists numpy arrays, space a SpaceKeys."""
    import torch
    from monai.data import MetaTensor
    from monai.utils import SpaceKeys

    meta = dict(meta or {})
    ops = meta.pop("applied_operations", None)
    affine = meta.pop("affine", None)
    if affine is not None:
        affine = torch.as_tensor(np.asarray(affine, dtype=np.float64))
    for k, v in meta.items():
        if isinstance(v, list) and k not in _LIST_META and _numeric(v):
            meta[k] = np.asarray(v, dtype=np.float64 if "affine" in k else None)
    if meta.get("space") in {s.value for s in SpaceKeys}:
        meta["space"] = SpaceKeys(meta["space"])
    out = MetaTensor(tensor, affine=affine, meta=meta)
    if ops:
        out.applied_operations = list(ops)
    return out


def meta_template(meta: Mapping[str, Any] | None, ndim: int) -> Any:
    """A MetaTensor carrying `meta` (as `restore_meta` makes it) for tensors of `ndim` dims: build it once
    per cached tensor, then `from_template` stamps items out of it without MetaTensor's constructor."""
    import torch

    return restore_meta(torch.empty((1,) * ndim), meta)


def from_template(tensor: Any, template: Any) -> Any:
    """`tensor` as a MetaTensor with a fresh copy of the template's state (its meta dict, affine, arrays and
    applied operations are its own: MONAI transforms mutate them in place). Equals
    `restore_meta(tensor, meta)` for the meta the template was made from, at a fraction of its cost."""
    from monai.data import MetaTensor

    out = tensor.as_subclass(MetaTensor)
    out.__dict__.update({k: _fresh(v) for k, v in template.__dict__.items()})
    return out


def _fresh(value: Any) -> Any:
    """A copy of a MetaTensor attribute deep enough that no mutable part is shared with the original."""
    import copy
    import enum

    import torch

    if value is None or isinstance(value, (str, int, float, bool, enum.Enum)):
        return value
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_fresh(v) for v in value)
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    return copy.deepcopy(value)


def _numeric(value: Any) -> bool:
    if isinstance(value, list):
        return all(_numeric(v) for v in value)
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _key(entry: Any) -> str:
    return json.dumps(to_jsonable(entry), sort_keys=True)


def tail_compose(transform: Any) -> Any:
    """The random tail of `transform` as a MONAI Compose with the user's Compose options (None if empty)."""
    from monai.transforms import Compose

    _, tail = chain.split(transform)
    if not tail:
        return None
    options = {n: getattr(transform, n) for n in _COMPOSE_OPTIONS if hasattr(transform, n)}
    return Compose(tail, **options)


def check_fingerprint(transform: Any, manifest: Mapping[str, Any], where: str) -> None:
    """StaleError unless the transform's head is the one the cache was prepared with."""
    head, _ = chain.split(transform)
    want = manifest.get("fingerprint")
    got = chain.fingerprint(head)
    if want != got:
        cached = "; ".join(manifest.get("head", []) or []) or "unknown"
        ours = "; ".join(chain.describe(head)) or "empty"
        raise StaleError(
            f"{where}: the cache was prepared with a different pipeline head (cache: {cached} | "
            f"this transform: {ours}; fingerprint {str(want)[:12]} != {got[:12]}); "
            "re-run `prep cache` with this pipeline or pass the pipeline the cache was made with"
        )


class _PersistentCore:
    """`PersistentDataset(data, transform, cache_dir)` over a prepared cache: head read, tail applied.

    data: the datalist entries (as for MONAI; matched to cache items by their source entry). transform:
    the full pipeline (Compose or list). cache_dir: the `prep cache` output. backend, device, verify and
    other options: as for PreparedDataset. A `monai.data.Dataset`, so slicing, DataLoader and
    ThreadDataLoader work as with PersistentDataset.
    """

    def __init__(
        self,
        data: Sequence[Any],
        transform: Any,
        cache_dir: str | os.PathLike[str],
        backend: str | Backend = "auto",
        device: str = "cpu",
        verify: bool = False,
        **options: Any,
    ) -> None:
        from loaders.dataset import PreparedDataset

        self.data = data
        self.transform = transform
        self.dataset = PreparedDataset(cache_dir, backend=backend, device=device, verify=verify, **options)
        check_fingerprint(transform, self.dataset.cache.manifest, str(self.dataset.root / MANIFEST))
        self.tail = tail_compose(transform)
        self._items: dict[str, int] | None = None

    def __len__(self) -> int:
        return len(self.data)

    def _lookup(self, index: int) -> int:
        """The cache item holding data[index]: same position when the sources agree, else by source entry."""
        cache = self.dataset.cache
        if self._items is None:
            if index < len(cache) and _key(cache.meta(index).get("source")) == _key(self.data[index]):
                return index
            self._items = {_key(cache.meta(i).get("source")): i for i in range(len(cache))}
        item = self._items.get(_key(self.data[index]))
        if item is None:
            raise StaleError(
                f"{self.dataset.root}: data[{index}] is not in the cache (quarantined, or the datalist changed "
                "since `prep cache`); re-run `prep cache` on this datalist"
            )
        return item

    def _transform(self, index: int) -> Any:
        # monai.data.Dataset.__getitem__ handles slices and index lists, then calls this per item
        head = self.dataset[self._lookup(int(index))]
        if self.tail is None:
            return head
        from monai.transforms import apply_transform

        return apply_transform(self.tail, head)

    def set_random_state(self, seed: int | None = None) -> Any:
        """Seed the tail's random transforms (the same objects as in `transform`)."""
        if self.tail is not None:
            self.tail.set_random_state(seed=seed)
        return self


def _build() -> type:
    monai_data = require("monai", "PreparedPersistentDataset").data
    cls = type(
        "PreparedPersistentDataset",
        (_PersistentCore, monai_data.Dataset),
        {"__module__": __name__, "__doc__": _PersistentCore.__doc__},
    )
    globals()["PreparedPersistentDataset"] = cls
    return cls


if TYPE_CHECKING:
    PreparedPersistentDataset = _PersistentCore
else:

    def __getattr__(name: str) -> Any:
        # Built on first use (a monai.data.Dataset subclass), so importing this module imports no MONAI.
        if name == "PreparedPersistentDataset":
            return _build()
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
