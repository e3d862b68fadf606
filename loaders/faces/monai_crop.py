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

__all__ = ["ask_batch_pages", "ask_crop_pages", "cropping", "leading_crop"]


def leading_crop(tail: Any, cache: Any) -> Fold | None:
    """The fold of the crop starting `tail` (a Compose), or None: no such crop, a lazy or item-mapping Compose
    (MONAI applies it whole), or a label-driven crop without sampling sets."""
    if tail is None or getattr(tail, "lazy", False) or not getattr(tail, "map_items", True):
        return None
    return split_fold(list(tail.transforms), list(cache.keys), cache)[0]


@contextlib.contextmanager
def cropping(fold: Fold, item: int, head: Mapping[str, Any], lock: threading.Lock, ask: bool = True) -> Iterator[None]:
    """The context MONAI's crop of cache item `item` runs in: the crop's pages asked for (unless `ask` is False:
    the caller did), the label-driven crop's sets in place. `lock` keeps the two draws of one item together where
    threads share the transform."""
    spatial = _spatial(fold, head)
    sets = fold.precomputed(item, spatial) if isinstance(fold, LabelCropFold) else contextlib.nullcontext()
    with lock, sets:
        if ask:
            with peeking(fold.transform):
                ask_crop_pages(fold, item, spatial, head)
        yield


def ask_batch_pages(fold: Fold, heads: Sequence[tuple[int, Mapping[str, Any]]], lock: threading.Lock) -> int:
    """Ask for the crop's pages of every (cache item, head) in `heads`, drawn one after the other as MONAI will
    draw them item by item (the crop's draws use its own random states only), the states put back after."""
    with lock, peeking(fold.transform):
        return sum(ask_crop_pages(fold, item, _spatial(fold, head), head, chained=True) for item, head in heads)


def _spatial(fold: Fold, head: Mapping[str, Any]) -> tuple[int, ...]:
    """The spatial shape MONAI draws the crop over."""
    return tuple(head[fold.spatial_key(list(head))].shape[1:])


def ask_crop_pages(
    fold: Fold, item: int, spatial: Sequence[int], head: Mapping[str, Any], chained: bool = False
) -> int:
    """Draw the windows `fold` draws next (inside `loaders.state.peeking`: the caller puts the random states back)
    and ask for their pages in every cropped key's mapped tensor of `head`. Where nothing is mapped nothing is
    drawn, unless `chained` (the next item's draw follows this one's). Returns the madvise calls made."""
    keys = dict.fromkeys(fold.transform.keys)
    mapped = [head[k] for k in keys if k in head and _mapped(head[k], spatial)]
    if not mapped and not chained:
        return 0
    windows = fold.draw(item, spatial)
    calls = 0
    for tensor in mapped:
        for start, shape in windows:
            spans = window_spans(tuple(tensor.shape), tensor.element_size(), start, shape)
            calls += will_need(tensor.data_ptr(), spans)
    return calls


def _mapped(value: Any, spatial: Sequence[int]) -> bool:
    """A C-order (channels, *spatial) torch tensor over a mapping of the shards (a numpy head, as MONAI 1.4 gives
    one back, is left to the kernel's readahead)."""
    import torch

    shape = tuple(getattr(value, "shape", ()))
    return (
        isinstance(value, torch.Tensor)
        and shape[1:] == tuple(spatial)
        and bool(value.is_contiguous())
        and value.numel() > 0
        and mapped_at(int(value.data_ptr()))
    )
