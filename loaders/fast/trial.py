"""`feeder="auto"` decided by measurement: whether the batches come faster to this training loop from the feeder's
child or from this process.

Neither wins everywhere (H200 box, 2026-11-28): a tail whose Python is the cost runs better beside the training
in a process of its own (`slices`: 0.60 of the ceiling in process, 0.83 fed), while a tail of many GPU kernels
runs worse there, its second CUDA context time-sliced against the training's (`seg-aug`: 0.77 in process, 0.66
fed). So the loop's period (from one batch handed to the next: the training step plus any wait for data) is
measured both ways on the same run: in this process while the child starts, then from the child once it has
made one whole epoch (its tier filled). Where the child's median period is longer than this process's by more
than `margin`, the batches come back here at the next epoch's start, from the same random states (the child
is closed, this process's tier fills again). The random states never depend on where a batch was made, so
the decision changes the speed only, never a value.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from loaders.tunables import TRIAL_LEAST, TRIAL_MARGIN, TRIAL_WINDOW

__all__ = ["FeederTrial"]


class FeederTrial:
    """Periods of the training loop with the batches made here and made by the feeder, and the verdict.

    `window`: the latest in-process periods kept (those after the tier filled weigh most); `least`: the periods
    of each kind (fed ones after the child's first whole epoch) needed before deciding, gathered over as many epochs as
    that takes; `margin`: how much longer the fed period may be before the batches come back here."""

    def __init__(self, window: int = TRIAL_WINDOW, least: int = TRIAL_LEAST, margin: float = TRIAL_MARGIN) -> None:
        self.here: deque[float] = deque(maxlen=window)
        self.fed: list[float] = []
        self.whole_fed = 0  # epochs the child made from their first batch to their last
        self.least, self.margin = least, margin
        self.verdict: str | None = None  # said once decided: kept, or taken back, with the two medians

    def watch(self, batches: Iterator[Any], made_here: Any) -> Iterator[Any]:
        """`batches` passed on, each arrival timed; `made_here()` counts the batches this process made (it
        moves when a batch came from here). At the epoch's end, `decide` may be called."""
        last: float | None = None
        count, last_here, whole = made_here(), False, True
        for batch in batches:
            now = time.perf_counter()
            here = made_here() != count
            count = made_here()
            whole = whole and not here
            if last is not None and last_here == here:  # a period across the hand-over is neither's
                if here:
                    self.here.append(now - last)
                elif self.whole_fed:
                    self.fed.append(now - last)
            last, last_here = now, here
            yield batch
        self.whole_fed += whole and last is not None

    def decide(self) -> bool | None:
        """None until there is enough to compare; then True where the batches should come back to this process
        (the verdict said in `verdict`), False where the feeder keeps them."""
        if self.verdict is not None or len(self.fed) < self.least:
            return None
        fed = statistics.median(self.fed)
        if len(self.here) < self.least:  # (nearly) every batch from the child (wait_feeder): nothing to compare
            self.verdict = f"feeder kept: {1000 * fed:.1f} ms a step, too few made in this process to compare"
            return False
        here = statistics.median(self.here)
        back = fed > here * (1 + self.margin)
        said = "batches made in this process again" if back else "feeder kept"
        self.verdict = f"{said}: {1000 * fed:.1f} ms a step fed, {1000 * here:.1f} ms made here"
        return back
