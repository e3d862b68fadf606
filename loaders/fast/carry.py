"""The next epoch begun in this process while the last batches of this one are still being trained on.

An epoch's first batch is otherwise made only when the training loop asks for it: the read and tail threads idle
through the last steps of an epoch, and the loop waits a whole batch (and the pipeline's filling) at every epoch's
start, which on short epochs (12 steps on `seg-aug` and `slices`) is most of the time it waits for data. So once an
epoch's last batch is submitted, the next epoch's first batches follow it on the same threads (`prefetch` in
flight, as within an epoch): the same draws in the same order as when the next epoch is asked for later, since each
stage is one thread that draws in batch order. The epoch begun ahead is used only when the next pass is exactly
that epoch from its first batch, on the same shard (its batches are compared); anything else drops it first (its
jobs waited for, every random state put back to the last batch delivered) and the pass starts as without it.
Between the two, the loader's own methods that read or set the random states (`state_dict` reads the position
of the last batch delivered, kept aside; `set_random_state`, `load_state_dict`, `set_epoch`, `shard`, `close`
drop it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from loaders.reading.ahead import InOrder


@dataclass
class NextEpoch:
    """The next epoch's first batches in flight on this epoch's pipeline (`reads`, and `tails` on a tail thread).
    Every random state as of this epoch's last batch, what a drop puts back, is the cursor's (`Cursor.end(ahead=)`)."""

    epoch: int
    chunks: list[np.ndarray]
    reads: InOrder
    tails: InOrder | None
    submitted: int = 0

    def fill(self, upto: int, submit: Callable[[list[np.ndarray], int], None]) -> None:
        """Submit the next epoch's batches up to index `upto` (within the epoch)."""
        while self.submitted <= min(upto, len(self.chunks) - 1):
            submit(self.chunks, self.submitted)
            self.submitted += 1

    def fits(self, epoch: int, skip: int, chunks: list[np.ndarray], tails: bool) -> bool:
        """Whether a pass of `epoch` from batch `skip` over `chunks` is the one begun here."""
        return (
            epoch == self.epoch
            and skip == 0
            and tails == (self.tails is not None)
            and len(chunks) == len(self.chunks)
            and all(np.array_equal(a, b) for a, b in zip(chunks, self.chunks))
        )

    def clear(self) -> None:
        """Its jobs dropped: those not started cancelled, the running ones waited for (their draws done)."""
        if self.tails is not None:
            self.tails.close()  # before the reads: a tail waiting for its batch's read gets it, or its cancellation
        self.reads.close()
