"""Batched random crops: each item's window is drawn by the MONAI transform, then sliced out of the batch.

Slicing is per item (a view), gathered into one tensor by a single stack; multi-sample crops give
`n * num_samples` items in the order MONAI's `list_data_collate` gives for the per-item list outputs.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from loaders.tail.batched import TailBatch, keys_of


def _spatial(batch: TailBatch, keys: list[Hashable]) -> tuple[int, ...] | None:
    """The spatial shape all `keys` share, or None (then MONAI's per-item path decides what happens)."""
    shapes = {tuple(int(s) for s in batch.data[k].shape[2:]) for k in keys if batch.is_batched(k)}
    if len(shapes) != 1 or any(not batch.is_batched(k) for k in keys):
        return None
    return shapes.pop()


def _crop(batch: TailBatch, keys: list[Hashable], windows: list[tuple[int, tuple[slice, ...]]]) -> None:
    """Output item j = input item windows[j][0] cut to windows[j][1], for every key in `keys`."""
    new = {}
    for k in keys:
        x = batch.data[k]
        new[k] = [x[i][(slice(None), *sl)] for i, sl in windows]
    batch.replace(new, [i for i, _ in windows])


def _rand_spatial_slices(cropper: Any, spatial: tuple[int, ...]) -> tuple[slice, ...]:
    """The window a `RandSpatialCrop` just drew (or its centre window when random_center=False)."""
    from monai.transforms import CenterSpatialCrop

    if cropper.random_center:
        return tuple(cropper._slices)
    return tuple(CenterSpatialCrop(cropper._size).compute_slices(spatial))


def rand_spatial_crop(t: Any, batch: TailBatch) -> bool:
    """RandSpatialCropd: one window per item (a random size gives ragged items, run per item after)."""
    from monai.transforms import RandSpatialCrop

    keys = keys_of(t, batch)
    spatial = _spatial(batch, keys)
    if spatial is None or type(t.cropper) is not RandSpatialCrop:
        return False
    windows = []
    for i in range(batch.n):
        t.randomize(spatial)
        windows.append((i, _rand_spatial_slices(t.cropper, spatial)))
    _crop(batch, keys, windows)
    return True


def rand_spatial_crop_samples(t: Any, batch: TailBatch) -> bool:
    """RandSpatialCropSamplesd: num_samples windows per item, item-major as list_data_collate flattens."""
    keys = keys_of(t, batch)
    spatial = _spatial(batch, keys)
    if spatial is None:
        return False
    samples = t.cropper  # RandSpatialCropSamples; its inner RandSpatialCrop draws each window
    windows: list[tuple[int, tuple[slice, ...]]] = []
    for i in range(batch.n):
        t.randomize()
        # MONAI re-seeds the sampler with the item's sub-seed before each key, so all keys share the windows
        samples.set_random_state(seed=int(t.sub_seed))
        for _ in range(samples.num_samples):
            samples.cropper.randomize(spatial)
            windows.append((i, _rand_spatial_slices(samples.cropper, spatial)))
    _crop(batch, keys, windows)
    return True


def rand_crop_by_pos_neg_label(t: Any, batch: TailBatch) -> bool:
    """RandCropByPosNegLabeld: centres drawn from each item's label (on its device), windows sliced out."""
    from monai.transforms import Crop
    from monai.utils import fall_back_tuple

    keys = keys_of(t, batch)
    spatial = _spatial(batch, keys)
    given = [k for k in (t.fg_indices_key, t.bg_indices_key) if k is not None and k in batch.data]
    label_ok = batch.is_batched(t.label_key) or t.label_key not in batch.data
    image_ok = t.image_key is None or batch.is_batched(t.image_key) or t.image_key not in batch.data
    if spatial is None or given or not (label_ok and image_ok):
        return False
    label, image = batch.data.get(t.label_key), batch.data.get(t.image_key) if t.image_key else None
    roi = fall_back_tuple(t.cropper.spatial_size, default=spatial)
    windows: list[tuple[int, tuple[slice, ...]]] = []
    for i in range(batch.n):
        t.randomize(None if label is None else label[i], None, None, None if image is None else image[i])
        for center in t.cropper.centers:
            windows.append((i, tuple(Crop.compute_slices(roi_center=center, roi_size=roi))))
    _crop(batch, keys, windows)
    return True
