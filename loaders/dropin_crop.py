"""The drop-in's leading `RandSpatialCropd`, read as its window only.

PersistentDataset runs the tail's first `RandSpatialCropd` over the whole head item it unpickled. The drop-in
hands MONAI's own transform a stand-in item instead: the same keys, shapes, dtypes and meta, each tensor a
zero broadcast to its shape (no memory). MONAI draws the window with its own random state and writes the crop's
meta (affine, applied operations) as it always does; then each cropped tensor's data becomes that window read
from the cache. The values are the window's bytes and the meta is MONAI's: the item PersistentDataset gives, from
the window's bytes alone (a 96^3 crop of a 160^3 volume: a fifth).

Only where that is the whole story: an eager tail whose first transform is exactly `RandSpatialCropd` (a
subclass may do more), every tensor of the item one of its keys, tensors on the host. Anything else takes the
whole-item path.
"""

from __future__ import annotations

from typing import Any

from loaders.folds import crop_window


class SpatialCropRead:
    """Stand-in items for `crop` and their windows' bytes from `dataset` (a PreparedDataset on the host)."""

    def __init__(self, crop: Any, dataset: Any) -> None:
        self.crop = crop
        self.dataset = dataset

    @classmethod
    def of(cls, tail: Any, dataset: Any) -> SpatialCropRead | None:
        """The reader for `tail`'s leading crop, or None where the whole item must be read."""
        from monai.transforms import RandSpatialCropd

        if tail is None or getattr(tail, "lazy", False) or not getattr(tail, "map_items", True):
            return None
        crop = tail.transforms[0] if tail.transforms else None
        if type(crop) is not RandSpatialCropd or getattr(crop, "lazy", False) or str(dataset.device) != "cpu":
            return None
        if getattr(dataset.reader, "staged", False) or not set(dataset.keys) <= set(crop.keys):
            return None
        return cls(crop, dataset)

    def shell(self, item: int) -> dict[str, Any] | None:
        """The head item with data-less tensors (None where a tensor would not come back as a tensor: a numpy
        array, a nested key, a scalar)."""
        import torch

        ds = self.dataset
        views = ds._plan(item).views
        if any(len(shape) < 2 for *_, shape in views):
            return None
        head = ds._assemble(item, {key: torch.zeros((), dtype=dt).expand(shape) for key, _, _, dt, shape in views})
        if not all(isinstance(head.get(key), torch.Tensor) for key, *_ in views):
            return None
        return dict(head)

    def windows(self, item: int) -> dict[str, Any]:
        """Per key, (start, shape) of the window the crop's last call cut (take it before the next draw)."""
        shapes = {key: shape for key, *_, shape in self.dataset._plan(item).views}
        return {key: crop_window(self.crop, shapes[key][1:]) for key in self.dataset.keys}

    def fill(self, item: int, data: Any, windows: dict[str, Any]) -> Any:
        """The crop's output with each cropped tensor's data read from the cache (its window, all channels).

        The window is laid out as MONAI's crop leaves it, a view into a volume-sized tensor at the same
        offsets (`torch.empty`: pages outside the window are never touched): reductions later in the tail
        (a mean, a std) then add in the same order as over PersistentDataset's view, to the last bit."""
        import torch

        shapes = {key: shape for key, *_, shape in self.dataset._plan(item).views}
        for key, (start, size) in windows.items():
            out = data[key]
            region = self.dataset.item_region(item, key, (0, *start), (out.shape[0], *size))
            if tuple(region.shape) != tuple(out.shape):
                raise RuntimeError(
                    f"{self.dataset.root}: item {item} key {key!r}: MONAI's crop gave {tuple(out.shape)}, the window "
                    f"read {tuple(region.shape)}; run this chain with PersistentDataset and report it"
                )
            volume = torch.empty(tuple(shapes[key]), dtype=region.dtype)
            view = volume[(slice(None), *(slice(a, a + n) for a, n in zip(start, size)))]
            view.copy_(region)
            out.data = view
        return data
