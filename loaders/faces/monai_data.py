"""The MONAI face of a prepared cache: `PreparedPersistentDataset`, a `monai.data.PersistentDataset` that reads
a prepared cache where one serves. This module imports MONAI; `loaders.faces.monai` holds the work and imports
none, and `loaders` hands the name out on first use."""

from __future__ import annotations

from loaders.deps import require

require("monai", "PreparedPersistentDataset")

from monai.data.dataset import PersistentDataset  # noqa: E402

from loaders.faces.monai import PersistentCore  # noqa: E402

__all__ = ["PreparedPersistentDataset"]


class PreparedPersistentDataset(PersistentCore, PersistentDataset):
    __doc__ = PersistentCore.__doc__
