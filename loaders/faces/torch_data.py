"""The torch faces of a prepared cache: `PreparedDataset` (a map-style `torch.utils.data.Dataset`) and
`PreparedBatches` (an `IterableDataset` of batches). This module imports torch; `loaders.faces.dataset` and
`loaders.faces.batches` hold the work and import none, and `loaders` hands these names out on first use."""

from __future__ import annotations

from loaders.deps import require

require("torch", "PreparedDataset and PreparedBatches")

from torch.utils.data import Dataset, IterableDataset  # noqa: E402

from loaders.faces.batches import BatchesCore  # noqa: E402
from loaders.faces.dataset import DatasetCore  # noqa: E402

__all__ = ["PreparedBatches", "PreparedDataset"]


class PreparedDataset(DatasetCore, Dataset):  # type: ignore[type-arg]
    __doc__ = DatasetCore.__doc__


class PreparedBatches(BatchesCore, IterableDataset):  # type: ignore[type-arg]
    __doc__ = BatchesCore.__doc__
