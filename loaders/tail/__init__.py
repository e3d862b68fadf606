"""The random tail of a MONAI chain applied to a whole batch at once, on the batch's device.

`BatchedTail(transform)(batch)` gives the tensors MONAI's per-item chain followed by `list_data_collate`
gives for the same random draws: each item's parameters are drawn by the MONAI transform objects themselves,
item by item, and the operation then runs once over the batch with torch ops. Transforms without a batched
version run per item through MONAI (said once, in one log line).

Light at import: torch and MONAI are imported by the functions that use them.
"""

from __future__ import annotations

from loaders.tail.batched import BatchedTail, batched_names
from loaders.tail.tailbatch import TailBatch

__all__ = ["BatchedTail", "TailBatch", "batched_names"]
