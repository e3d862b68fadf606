"""The MONAI face of a prepared cache: `PreparedPersistentDataset`, a `monai.data.Dataset` in place of MONAI's
`PersistentDataset`. This module imports MONAI; `loaders.monai` holds the work and hands the name out on
first use, so importing it stays light."""

from __future__ import annotations

from monai.data import Dataset

from loaders.monai import PersistentCore

__all__ = ["PreparedPersistentDataset"]


class PreparedPersistentDataset(PersistentCore, Dataset):
    __doc__ = PersistentCore.__doc__
    __module__ = "loaders.monai"
