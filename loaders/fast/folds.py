"""Folds: random crops at the start of the tail drawn before the read, so only the crop's bytes are read.

A fold stands for one MONAI crop transform. It draws each item's windows with the transform's own random
state and MONAI's own draw functions, in batch order (MONAI's per-item chain draws the same), from what it
knows without the tensors: the spatial shape from the cache's index, and for label-driven crops the sampling
sets `prep cache` stored (`loaders.cache.sampling`). The loader then reads the windows (or slices them from items
resident on the device) and hands the rest of the tail crops of equal shape.

The registry maps the exact MONAI class to its fold: a user's subclass may change what the transform does,
so it is never folded (it runs through MONAI).

    RandSpatialCropd          one window per item (random or centred, fixed or random size)
    RandScaleCropd            the same, its size a fraction of the item's spatial shape
    RandSpatialCropSamplesd   `num_samples` such windows per item, from one sub-seed the transform draws
    RandCropByPosNegLabeld    `num_samples` windows centred on foreground/background voxels (pos/neg ratio)
    RandCropByLabelClassesd   `num_samples` windows centred on voxels of classes drawn by `ratios`
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from loaders.cache import sampling
from loaders.tail.crops import draw_samples, draw_spatial

Window = tuple[list[int], list[int]]  # (start, shape) over the spatial dims

_log = logging.getLogger("loaders.fast.folds")
_said: set[str] = set()


class Fold:
    """One folded crop: `draw(item, spatial)` -> the item's windows, drawn as MONAI draws them."""

    def __init__(self, transform: Any) -> None:
        self.transform = transform

    def draw(self, item: int, spatial: Sequence[int]) -> list[Window]:
        raise NotImplementedError

    def spatial_key(self, keys: Sequence[str]) -> str:
        """The key whose spatial shape the draw takes (MONAI's: the transform's first key the item has)."""
        return next((k for k in self.transform.keys if k in keys), keys[0])


class SpatialCropFold(Fold):
    """RandSpatialCropd, RandScaleCropd: one window per item."""

    def draw(self, item: int, spatial: Sequence[int]) -> list[Window]:
        return [draw_crop(self.transform, spatial)]


class SpatialSamplesFold(Fold):
    """RandSpatialCropSamplesd: `num_samples` windows per item, the same for every key (folded only where the
    cropped keys of every item share one spatial shape: MONAI draws each key's over its own shape)."""

    def draw(self, item: int, spatial: Sequence[int]) -> list[Window]:
        return [_window(s, spatial) for s in draw_samples(self.transform, tuple(spatial))]


def draw_crop(crop: Any, spatial: Sequence[int]) -> Window:
    """(start, shape) over the spatial dims, drawn as MONAI's `RandSpatialCropd` draws it for one item."""
    return _window(draw_spatial(crop, tuple(spatial)), spatial)


def _window(slices: Sequence[slice], spatial: Sequence[int]) -> Window:
    """A window from crop slices (ends past the volume cut at it, as slicing does)."""
    start = [min(int(s.start or 0), n) for s, n in zip(slices, spatial)]
    stop = [min(int(s.stop if s.stop is not None else n), n) for s, n in zip(slices, spatial)]
    start += [0] * (len(spatial) - len(start))
    stop += list(spatial[len(stop) :])
    return start, [max(b - a, 0) for a, b in zip(start, stop)]


class LabelCropFold(Fold):
    """RandCropByPosNegLabeld / RandCropByLabelClassesd: centres drawn by the transform's own `randomize`
    from the stored sets (`loaders.cache.sampling.MaskSet` stands in for MONAI's index lists), windows as MONAI's
    `SpatialCrop` cuts them."""

    def __init__(self, transform: Any, store: sampling.SetStore, classes: bool) -> None:
        super().__init__(transform)
        self.store, self.classes = store, classes

    def spatial_key(self, keys: Sequence[str]) -> str:
        return str(self.transform.label_key)  # MONAI draws over the label's shape

    def given(self, item: int, spatial: Sequence[int]) -> dict[str, Any]:
        """The item's sets as the index arguments of the cropper's `randomize` (what MONAI would list)."""
        sets = self.store.sets(item, math.prod(spatial))
        if self.classes:
            cap = self.transform.cropper.max_samples_per_class
            return {"indices": [s.keeping(cap) for s in sets]}
        return {"fg_indices": sets[0], "bg_indices": sets[1]}

    @contextlib.contextmanager
    def precomputed(self, item: int, spatial: Sequence[int]) -> Iterator[None]:
        """The transform itself, run by MONAI, draws from the item's sets: its cropper's own indices (used when
        the call passes none) are set for the duration (callers hold a lock where threads share it)."""
        cropper = self.transform.cropper
        names = ("indices",) if self.classes else ("fg_indices", "bg_indices")
        for name, value in self.given(item, spatial).items():
            setattr(cropper, name, value)
        try:
            yield
        finally:
            for name in names:
                setattr(cropper, name, None)

    def draw(self, item: int, spatial: Sequence[int]) -> list[Window]:
        from monai.transforms import Crop
        from monai.utils import fall_back_tuple

        t = self.transform
        t.cropper.randomize(label=sampling.shape_only((1, *spatial)), **self.given(item, spatial))
        roi = fall_back_tuple(t.cropper.spatial_size, default=tuple(spatial))
        return [_window(Crop.compute_slices(roi_center=c, roi_size=roi), spatial) for c in t.cropper.centers]


def _same_spatial(t: Any, cache: Any, also: Sequence[str | None] = ()) -> bool:
    """Whether every item's keys that `t` crops (and `also`: the keys it draws over) share one spatial shape
    (from the index): one window read for every key, as MONAI cuts them. Elsewhere (a label smaller than its
    image) the crop runs in the tail."""
    keys = [k for k in dict.fromkeys((*t.keys, *also)) if cache is not None and k is not None and k in cache.keys]
    return cache is not None and bool(keys) and bool(cache.same_spatial(keys))


def _spatial_fold(t: Any, cache: Any) -> Fold | None:
    """RandSpatialCropd, RandScaleCropd: one window per item, drawn over the transform's first key's shape."""
    return SpatialCropFold(t) if cache is None or _same_spatial(t, cache) else None


def _samples_fold(t: Any, cache: Any) -> Fold | None:
    """RandSpatialCropSamplesd (MONAI draws each key's windows over its own shape): where the keys share one."""
    return SpatialSamplesFold(t) if _same_spatial(t, cache) else None


def _label_fold(t: Any, cache: Any) -> Fold | None:
    sig = sampling.signature(t)
    if sig is None or cache is None or not _same_spatial(t, cache, (sig["label_key"], sig["image_key"])):
        return None
    store = sampling.open_store(cache, sig)
    if store is None:
        said = f"{cache.root}:{sig}"
        if said not in _said:  # the slow path, said once per cache and crop
            _said.add(said)
            _log.warning(
                "%s: no sampling sets for %s, so its crops are drawn from whole labels (slow); add them with "
                "`prep sampling %s --pipeline PIPELINE.py`",
                cache.root,
                type(t).__name__,
                cache.root,
            )
        return None
    return LabelCropFold(t, store, classes=sig["kind"] == "classes")


def _registry() -> dict[type, Callable[[Any, Any], Fold | None]]:
    from monai.transforms import (
        RandCropByLabelClassesd,
        RandCropByPosNegLabeld,
        RandScaleCropd,
        RandSpatialCropd,
        RandSpatialCropSamplesd,
    )

    return {RandSpatialCropd: _spatial_fold, RandScaleCropd: _spatial_fold, RandSpatialCropSamplesd: _samples_fold,
            RandCropByPosNegLabeld: _label_fold, RandCropByLabelClassesd: _label_fold}  # fmt: skip


def is_fold_crop(t: Any) -> bool:
    """Whether `t` is of a crop class the loaders fold (drawn before the read), whatever its keys."""
    return type(t) in _registry()


def label_fold(tail: Sequence[Any], cache: Any) -> LabelCropFold | None:
    """The label-driven crop starting the tail, with its stored sets (None: no such crop, or no sets)."""
    first = tail[0] if tail else None
    if first is None or _registry().get(type(first)) is not _label_fold or getattr(first, "lazy", False):
        return None
    fold = _label_fold(first, cache)
    return fold if isinstance(fold, LabelCropFold) else None


def may_fold(tail: Sequence[Any], options: dict[str, Any]) -> bool:
    """Whether the tail's leading crop may be drawn apart from the rest (folded into the read): not under
    lazy resampling or other item mapping (MONAI applies the chain as one), nor when the crop object is
    used again in the tail (MONAI draws its uses item by item)."""
    eager = options.get("lazy", False) is not True and options.get("map_items", True) in (True, 1)
    return eager and not options.get("unpack_items", False) and bool(tail) and tail[0] not in tail[1:]


def split_fold(tail: Sequence[Any], keys: Sequence[str], cache: Any = None) -> tuple[Fold | None, list[Any]]:
    """(the fold of the tail's first transform or None, the rest of the tail). Folded: an eager transform of
    a registered class (exactly: no subclass) that crops loaded keys (the others pass through whole, as
    MONAI passes them), whose draws need nothing the cache lacks (label-driven crops: the sampling sets)."""
    first = tail[0] if tail else None
    build = _registry().get(type(first))
    if first is None or build is None or getattr(first, "lazy", False) or not set(keys) & set(first.keys):
        return None, list(tail)
    label = getattr(first, "label_key", None)
    if label is not None and (label not in keys or label not in first.keys):
        return None, list(tail)  # the draw needs the label's shape, and a label it does not crop stays whole
    fold = build(first, cache)
    return (fold, list(tail[1:])) if fold is not None else (None, list(tail))


def crop_sets_of(tail: Sequence[Any]) -> dict[str, Any] | None:
    """The sampling signature `prep cache` prepares sets for: the tail's first transform's, if label-driven."""
    return sampling.signature(tail[0]) if tail else None


__all__ = [
    "Fold", "LabelCropFold", "SpatialCropFold", "SpatialSamplesFold", "Window", "crop_sets_of", "draw_crop",
    "is_fold_crop", "label_fold", "may_fold", "split_fold",
]  # fmt: skip
