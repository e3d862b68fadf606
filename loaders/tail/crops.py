"""Batched random crops: each item's window is drawn by the MONAI transform, then sliced out of the batch.

Slicing is per item (a view), gathered into one tensor by a single stack; multi-sample crops give
`n * num_samples` items in the order MONAI's `list_data_collate` gives for the per-item list outputs.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from loaders.tail.tailbatch import TailBatch, keys_of


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
        new[k] = [x[(i, slice(None), *sl)] for i, sl in windows]
    batch.replace(new, [i for i, _ in windows])


def spatial_slices(cropper: Any, spatial: tuple[int, ...]) -> tuple[slice, ...]:
    """The window a `RandSpatialCrop` just drew (or its centre window when random_center=False)."""
    from monai.transforms import CenterSpatialCrop

    if cropper.random_center:
        return tuple(cropper._slices)
    return tuple(CenterSpatialCrop(cropper._size).compute_slices(spatial))


def draw_spatial(t: Any, spatial: tuple[int, ...]) -> tuple[slice, ...]:
    """RandSpatialCropd's (or RandScaleCropd's) window for one item of spatial shape `spatial`, drawn as MONAI
    draws it."""
    t.randomize(list(spatial))
    return spatial_slices(t.cropper, spatial)


def draw_samples(t: Any, spatial: tuple[int, ...]) -> list[tuple[slice, ...]]:
    """RandSpatialCropSamplesd's `num_samples` windows for one item, drawn as MONAI draws them: a sub-seed from
    the transform, with which MONAI re-seeds its sampler before each key (so keys of one shape share them)."""
    t.randomize()
    samples = t.cropper  # RandSpatialCropSamples; its inner RandSpatialCrop draws each window
    reseed(samples, int(t.sub_seed))
    out = []
    for _ in range(samples.num_samples):
        samples.cropper.randomize(list(spatial))
        out.append(spatial_slices(samples.cropper, spatial))
    return out


def reseed(samples: Any, seed: int) -> None:
    """`samples.set_random_state(seed=seed)` as MONAI's RandSpatialCropSamples does it (a legacy RandomState
    seeded with `seed` for it and one for its inner crop), the two it already holds seeded again in place: a
    new RandomState costs ~0.25 ms (numpy first seeds it from the OS), two an item, and the loader's snapshots
    find a generator's bytes again for every new one. Where it holds anything else, MONAI's own call."""
    import numpy as np
    from monai.transforms import RandSpatialCropSamples
    from monai.transforms.transform import Randomizable
    from monai.utils import MAX_SEED

    inner: Any = getattr(samples, "cropper", None)
    legacy = np.random.RandomState
    own = (
        type(samples).set_random_state is RandSpatialCropSamples.set_random_state
        and type(inner).set_random_state is Randomizable.set_random_state
        and type(samples.R) is legacy
        and type(inner.R) is legacy
        and samples.R is not inner.R
    )
    if not own:
        samples.set_random_state(seed=seed)
        return
    samples.R.seed(seed % MAX_SEED)
    inner.R.seed(seed % MAX_SEED)


def rand_spatial_crop(t: Any, batch: TailBatch) -> bool:
    """RandSpatialCropd, RandScaleCropd (its size a fraction of the item's): one window per item (a random size
    gives ragged items, run per item after)."""
    from monai.transforms import RandScaleCrop, RandSpatialCrop

    keys = keys_of(t, batch)
    spatial = _spatial(batch, keys)
    if spatial is None or type(t.cropper) not in (RandSpatialCrop, RandScaleCrop):
        return False
    windows = [(i, draw_spatial(t, spatial)) for i in range(batch.n)]
    _crop(batch, keys, windows)
    return True


def rand_spatial_crop_samples(t: Any, batch: TailBatch) -> bool:
    """RandSpatialCropSamplesd: num_samples windows per item, item-major as list_data_collate flattens."""
    keys = keys_of(t, batch)
    spatial = _spatial(batch, keys)
    if spatial is None:
        return False
    windows = [(i, sl) for i in range(batch.n) for sl in draw_samples(t, spatial)]
    _crop(batch, keys, windows)
    return True


class _Indices:
    """Flat positions of the nonzero voxels of one item's mask, found on the mask's device only when asked.

    MONAI's `map_binary_to_indices` lists every foreground and background voxel and copies both lists to the
    host (32 MB for a 160^3 background); the centre draw only needs their counts and the few entries picked,
    so these stand in for the lists (`generate_pos_neg_label_crop_centers` takes any sized, indexable one).
    Counts are kept per slice of the first spatial axis, so a lookup searches one slice, not the volume.
    """

    def __init__(self, rows: Any, counts: list[int]) -> None:
        import numpy as np

        self._rows = rows  # (slices, voxels per slice), nonzero = in the set
        self._cum = np.cumsum(np.asarray(counts, dtype=np.int64))
        self._count = int(self._cum[-1]) if len(counts) else 0

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, k: Any) -> int:
        import numpy as np
        import torch

        k = int(k)
        if not 0 <= k < self._count:
            raise IndexError(k)
        s = int(np.searchsorted(self._cum, k, side="right"))
        before = int(self._cum[s - 1]) if s else 0
        hits = torch.nonzero(self._rows[s]).flatten()
        return s * int(self._rows.shape[1]) + int(hits[k - before])


def _pos_neg_indices(t: Any, label: Any, image: Any) -> list[tuple[_Indices, _Indices]]:
    """Each item's foreground/background positions as `map_binary_to_indices` finds them, in a few batch ops.

    The same ops on purpose: `torch.any` of a uint8 label is uint8, so MONAI's `~` is a bitwise not and,
    without `image_key`, every voxel of a uint8 label counts as background (foreground included). The draws
    must be MONAI's, so that is kept.
    """
    import torch

    n, slices = int(label.shape[0]), int(label.shape[2])
    lab = label[:, 1:] if label.shape[1] > 1 else label  # one-hot: the background channel is dropped
    fg_any = torch.any(lab, dim=1)
    bg_any = ~fg_any
    if image is not None:
        bg_any = torch.any(image > t.cropper.image_threshold, dim=1) & bg_any
    fg, bg = fg_any.reshape(n, slices, -1), bg_any.reshape(n, slices, -1)
    # one small table read back for the whole batch: (n, slices) counts per set
    if image is None:  # the background is the complement (bool) or, for uint8's bitwise not, every voxel
        fg_counts = torch.count_nonzero(fg, dim=2).tolist()
        per_slice = int(fg.shape[2])
        bg_counts = [[per_slice - c if fg.dtype == torch.bool else per_slice for c in row] for row in fg_counts]
    else:
        table = torch.stack([torch.count_nonzero(fg, dim=2), torch.count_nonzero(bg, dim=2)], dim=1).tolist()
        fg_counts, bg_counts = [row[0] for row in table], [row[1] for row in table]
    return [(_Indices(fg[i], fg_counts[i]), _Indices(bg[i], bg_counts[i])) for i in range(n)]


def _label_and_image(t: Any, batch: TailBatch, spatial: tuple[int, ...]) -> tuple[Any, Any] | None:
    """A label-driven crop's label and image (None without `image_key`), or None where either's spatial shape is
    not the keys' (MONAI draws over the label's own shape: per item)."""
    label, image = batch.data[t.label_key], batch.data.get(t.image_key) if t.image_key else None
    if tuple(label.shape[2:]) != spatial or (image is not None and tuple(image.shape[2:]) != spatial):
        return None
    return label, image


def rand_crop_by_pos_neg_label(t: Any, batch: TailBatch) -> bool:
    """RandCropByPosNegLabeld: centres drawn from each item's label (on its device), windows sliced out."""
    from monai.transforms import Crop
    from monai.utils import fall_back_tuple

    keys = keys_of(t, batch)
    spatial = _spatial(batch, keys)
    given = [k for k in (t.fg_indices_key, t.bg_indices_key) if k is not None and k in batch.data]
    label_ok = batch.is_batched(t.label_key)
    image_ok = t.image_key is None or batch.is_batched(t.image_key) or t.image_key not in batch.data
    own = t.cropper.fg_indices is not None or t.cropper.bg_indices is not None
    if spatial is None or given or own or not (label_ok and image_ok):
        return False
    found = _label_and_image(t, batch, spatial)
    if found is None:
        return False
    label, image = found
    roi = fall_back_tuple(t.cropper.spatial_size, default=spatial)
    windows: list[tuple[int, tuple[slice, ...]]] = []
    for i, (fg, bg) in enumerate(_pos_neg_indices(t, label, image)):
        t.randomize(label[i], fg, bg, None if image is None else image[i])
        for center in t.cropper.centers:
            windows.append((i, tuple(Crop.compute_slices(roi_center=center, roi_size=roi))))
    _crop(batch, keys, windows)
    return True


def rand_weighted_crop(t: Any, batch: TailBatch) -> bool:
    """RandWeightedCropd: each item's `num_samples` centres drawn by MONAI's own `randomize` from the item's weight
    map (first channel, on its device), the windows sliced out item-major as `list_data_collate` flattens."""
    from monai.transforms import Crop
    from monai.utils import fall_back_tuple

    keys = keys_of(t, batch)
    spatial = _spatial(batch, keys)
    if spatial is None or getattr(t, "lazy", False) or not batch.is_batched(t.w_key):
        return False
    weights = batch.data[t.w_key]
    if tuple(int(s) for s in weights.shape[2:]) != spatial:
        return False  # MONAI warns and samples the map's own shape: per item
    roi = fall_back_tuple(t.cropper.spatial_size, default=spatial)
    windows: list[tuple[int, tuple[slice, ...]]] = []
    for i in range(batch.n):
        t.randomize(weight_map=weights[i])
        windows += [(i, tuple(Crop.compute_slices(roi_center=c, roi_size=roi))) for c in t.cropper.centers]
    _crop(batch, keys, windows)
    return True


def rand_crop_by_label_classes(t: Any, batch: TailBatch) -> bool:
    """RandCropByLabelClassesd: each item's `num_samples` centres drawn by MONAI's own `randomize` from the item's
    label (its classes' voxels found as MONAI finds them), the windows sliced out item-major as `list_data_collate`
    flattens. Per item through MONAI where the indices may come with the data (`indices_key`) or come with the
    transform, or it is lazy."""
    from monai.transforms import Crop
    from monai.utils import fall_back_tuple

    keys = keys_of(t, batch)
    spatial = _spatial(batch, keys)
    image_ok = t.image_key is None or t.image_key not in batch.data or batch.is_batched(t.image_key)
    given = t.indices_key is not None  # the head's indices (a list: kept as "key/0", "key/1", ...) or none
    if spatial is None or given or t.cropper.indices is not None or getattr(t, "lazy", False):
        return False
    if t.label_key not in batch.data or not batch.is_batched(t.label_key) or not image_ok:
        return False
    found = _label_and_image(t, batch, spatial)
    if found is None:
        return False
    label, image = found
    roi = fall_back_tuple(t.cropper.spatial_size, default=spatial)
    windows: list[tuple[int, tuple[slice, ...]]] = []
    for i in range(batch.n):
        t.randomize(label[i], None, None if image is None else image[i])
        windows += [(i, tuple(Crop.compute_slices(roi_center=c, roi_size=roi))) for c in t.cropper.centers]
    _crop(batch, keys, windows)
    return True
