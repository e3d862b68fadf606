"""The torch faces of a prepared cache: `PreparedDataset` (a map-style `torch.utils.data.Dataset`) and
`PreparedBatches` (an `IterableDataset` of batches). This module imports torch; `loaders.dataset` and
`loaders.batches` hold the work and hand these names out on first use, so importing them stays light."""

from __future__ import annotations

from torch.utils.data import Dataset, IterableDataset

from loaders.batches import BatchesCore
from loaders.dataset import DatasetCore

__all__ = ["PreparedBatches", "PreparedDataset"]


class PreparedDataset(DatasetCore, Dataset):  # type: ignore[type-arg]
    __doc__ = DatasetCore.__doc__
    __module__ = "loaders.dataset"


class PreparedBatches(BatchesCore, IterableDataset):  # type: ignore[type-arg]
    __doc__ = BatchesCore.__doc__
    __module__ = "loaders.batches"
