"""The drop-in's leading crop: MONAI runs it on the item's mapped tensors, and only the crop's pages are read.

A crop the loaders fold (`loaders.fast.folds`) starting the tail is drawn twice: first here, with every random
state put back after (`loaders.state.peeking`), to ask the kernel for the crop's pages of every cropped key at
once (madvise WILLNEED over the window's byte runs: many reads in flight, none wider than the window); then by
MONAI itself, which draws the same windows and cuts them from pages already read or under way. Without the first
draw each page the crop touches is a synchronous fault, widened by the kernel's readahead (about 4x the crop's
bytes on a cold page cache, docs/benchmarks.md). A label-driven crop draws from the cache's sampling sets, not
by scanning the label (`LabelCropFold.precomputed`).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from loaders.fast.folds import Fold, LabelCropFold, split_fold
from loaders.reading.mappings import mapped_at, will_need
from loaders.reading.region import window_spans
from loaders.state import peeking

__all__ = ["cropping", "leading_crop"]


def leading_crop(tail: Any, cache: Any) -> Fold | None:
    """The fold of the crop starting `tail` (a Compose), or None: no such crop, a lazy or item-mapping Compose
    (MONAI applies it whole), or a label-driven crop without sampling sets."""
    if tail is None or getattr(tail, "lazy", False) or not getattr(tail, "map_items", True):
        return None
    return split_fold(list(tail.transforms), list(cache.keys), cache)[0]


@contextlib.contextmanager
def cropping(fold: Fold, item: int, head: Mapping[str, Any], lock: threading.Lock) -> Iterator[None]:
    """The context MONAI's crop of cache item `item` runs in: the crop's pages asked for, the label-driven crop's
    sets in place. `lock` keeps the two draws of one item together where threads share the transform."""
    spatial = tuple(head[fold.spatial_key(list(head))].shape[1:])  # the shape MONAI draws over
    sets = fold.precomputed(item, spatial) if isinstance(fold, LabelCropFold) else contextlib.nullcontext()
    with lock, sets:
        ask_crop_pages(fold, item, spatial, head)
        yield


def ask_crop_pages(fold: Fold, item: int, spatial: Sequence[int], head: Mapping[str, Any]) -> int:
    """Ask for the pages of the windows `fold` draws next, in every cropped key's mapped tensor of `head`; the
    transform's random states are as before. Returns the madvise calls made (none where nothing is mapped)."""
    keys = dict.fromkeys(fold.transform.keys)
    mapped = [head[k] for k in keys if k in head and _mapped(head[k], spatial)]
    if not mapped:
        return 0
    with peeking(fold.transform):
        windows = fold.draw(item, spatial)
    calls = 0
    for tensor in mapped:
        for start, shape in windows:
            spans = window_spans(tuple(tensor.shape), tensor.element_size(), start, shape)
            calls += will_need(tensor.data_ptr(), spans)
    return calls


def _mapped(value: Any, spatial: Sequence[int]) -> bool:
    """A C-order (channels, *spatial) tensor over a mapping of the shards."""
    shape = tuple(getattr(value, "shape", ()))
    return (
        shape[1:] == tuple(spatial)
        and bool(value.is_contiguous())
        and value.numel() > 0
        and mapped_at(int(value.data_ptr()))
    )
