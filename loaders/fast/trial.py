"""`feeder="auto"` decided by measurement: whether the batches come faster to this training loop from a feeder's
child or from this process, and from which kind of child.

Neither wins everywhere (H200 box, 2026-11-28): a tail whose Python is the cost runs better beside the training
in a process of its own (`slices`: 0.60 of the ceiling in process, 0.83 fed), while a tail of many GPU kernels
runs worse there, its second CUDA context time-sliced against the training's (`seg-aug`: 0.77 in process, 0.66
fed). So the loop's period (from one batch handed to the next: the training step plus any wait for data) is
measured both ways on the same run: in this process while the child starts, then from the child once it has
made one whole epoch (its tier filled). Where the child's median period is longer than this process's by more
than `margin`, the batches come back here at the next epoch's start, from the same random states (the child
is closed, this process's tier fills again).

Where a host feeder is a candidate too (`loaders.fast.hostfeed`: a child without CUDA, its batches' tails replayed
in this process: one context, `seg-elastic` 0.88 of the ceiling against 0.80 with a CUDA child, `spheres` 0.58
against 0.75), it is tried next: started at the first verdict's epoch end, its periods counted from its first
batches (it has no tier to fill, its first few left out), and kept where its median beats the first verdict's
choice by more than `margin`; else that choice comes back. The random states never depend on where a batch was
made, so every decision changes the speed only, never a value.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterator
from typing import Any

from loaders.tunables import (
    HOST_FEED_FIRST,
    HOST_FEED_LOOK,
    HOST_FEED_PERIOD,
    TRIAL_LEAST,
    TRIAL_MARGIN,
    TRIAL_SKIP,
    TRIAL_WINDOW,
)

__all__ = ["FeederTrial", "host_at_start"]

# what `decide` asks of the loader
HERE, KEEP, HOST, DEVICE = "here", "keep", "host", "device"


class FeederTrial:
    """Periods of the training loop with the batches made here and made by the feeder, and the verdict.

    `window`: the latest in-process periods kept (those after the tier filled weigh most); `least`: the periods
    of each kind (fed ones after the child's first whole epoch) needed before deciding, gathered over as many epochs as
    that takes; `margin`: how much longer the fed period may be before the batches come back here; `host`: a host
    feeder's child tried once the first child is measured."""

    def __init__(
        self, window: int = TRIAL_WINDOW, least: int = TRIAL_LEAST, margin: float = TRIAL_MARGIN, host: bool = False
    ) -> None:
        self.here: deque[float] = deque(maxlen=window)
        self.fed: list[float] = []
        self.whole_fed = 0  # epochs the child made from their first batch to their last
        self.least, self.margin = least, margin
        self.host = host
        self.first: tuple[str, float, str] | None = None  # host feeder tried: (HERE or DEVICE, its period, why)
        self.verdict: str | None = None  # said once decided: kept, or taken back, with the medians

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
                elif self.whole_fed or self.first is not None:
                    self.fed.append(now - last)
            last, last_here = now, here
            yield batch
        self.whole_fed += whole and last is not None

    def decide(self) -> str | None:
        """None until there is enough to compare; then what the loader does, once: HERE (the batches come back to
        this process), KEEP (the child making them keeps them), HOST (a host feeder's child tried next: the verdict
        waits for it) or DEVICE (the first child again, the host feeder having lost). Said in `verdict`."""
        if self.verdict is not None:
            return None
        if self.first is None:
            return self._first()
        fed = self.fed[TRIAL_SKIP:]  # the host feeder's first batches: its graphs captured here, its slots made
        if len(fed) < self.least:
            return None
        host = statistics.median(fed)
        kind, period, said = self.first
        if host * (1 + self.margin) < period:
            self.verdict = f"host feeder kept: {1000 * host:.1f} ms a step; {said}"
            return KEEP
        self.verdict = f"{said}; host feeder {1000 * host:.1f} ms a step"
        return kind

    def _first(self) -> str | None:
        """The first child against this process: HERE or KEEP, or HOST where a host feeder is tried next."""
        if len(self.fed) < self.least:
            return None
        fed = statistics.median(self.fed)
        if len(self.here) < self.least:  # (nearly) every batch from the child (wait_feeder): nothing to compare
            kind, period = DEVICE, fed
            said = f"feeder kept: {1000 * fed:.1f} ms a step, too few made in this process to compare"
        else:
            here = statistics.median(self.here)
            back = fed > here * (1 + self.margin)
            kind, period = (HERE, here) if back else (DEVICE, fed)
            said = "batches made in this process again" if back else "feeder kept"
            said = f"{said}: {1000 * fed:.1f} ms a step fed, {1000 * here:.1f} ms made here"
        if self.host:
            self.first, self.fed = (kind, period, said), []
            return HOST
        self.verdict = said
        return HERE if kind == HERE else KEEP


def host_at_start(periods: list[float], drawable: bool | None, later: bool) -> bool | None:
    """Whether the feeder's child, not started yet, is a host feeder's (`loaders.tunables.HOST_FEED` "chosen"):
    where the tail is drawable (the first batch made here tells) and the training loop's median period over the
    latest `HOST_FEED_LOOK` of `periods` (the batches made here) is at least `HOST_FEED_PERIOD`, so the host
    feeder's work in this process (its takes and replays) hides in the step. `later`: the periods are of an epoch
    after the first made here (whose periods the device tier's filling and the tail's first captures lengthen);
    without it, `HOST_FEED_FIRST` periods of the first are needed. None until there are enough."""
    if drawable is not True:
        return False
    if len(periods) < (HOST_FEED_LOOK + 1 if later else HOST_FEED_FIRST):
        return None
    return statistics.median(periods[-HOST_FEED_LOOK:]) >= HOST_FEED_PERIOD
