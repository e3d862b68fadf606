"""Progress for people: a tqdm bar on a terminal, periodic log lines elsewhere (SLURM logs, CI, pipes).

    with Progress(total=1000, desc="prep cache") as progress:
        for item in items:
            ...
            progress.update()

Without a terminal it writes one line every `interval` seconds and one at the end, e.g.
``prep cache: 120/1000 items, 35.2 items/s, ETA 25 s``.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, TextIO


def format_duration(seconds: float) -> str:
    """A short human duration: "25 s", "3 min 5 s", "2 h 10 min"."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    return f"{s // 3600} h {s % 3600 // 60} min"


class Progress:
    """Count finished work and show it: tqdm on a TTY, else a line every `interval` seconds and at the end.

    `total` may be None (unknown) or changed later with `reset(total)`; `update` is thread-safe.
    """

    def __init__(
        self, total: int | None, desc: str, unit: str = "items", interval: float = 10.0, stream: TextIO | None = None
    ) -> None:
        self.total = total
        self.desc = desc
        self.unit = unit
        self.interval = interval
        self.stream: TextIO = stream if stream is not None else sys.stderr
        self.n = 0
        self._lock = threading.Lock()
        self._bar: Any = None
        self._t0 = time.monotonic()
        self._last = self._t0
        self._closed = False

    def _is_tty(self) -> bool:
        isatty = getattr(self.stream, "isatty", None)
        try:
            return bool(isatty and isatty())
        except ValueError:  # a closed stream
            return False

    def __enter__(self) -> Progress:
        self._t0 = self._last = time.monotonic()
        if self._is_tty():
            from tqdm import tqdm

            unit = self.unit[:-1] if self.unit.endswith("s") else self.unit  # tqdm appends "/s" to the unit
            self._bar = tqdm(
                total=self.total, desc=self.desc, unit=unit, file=self.stream, dynamic_ncols=True, leave=False
            )
        return self

    def reset(self, total: int | None) -> None:
        """Set the total (e.g. once a run knows how many items are left); keeps the count."""
        with self._lock:
            self.total = total
            if self._bar is not None:
                self._bar.total = total
                self._bar.refresh()

    def update(self, n: int = 1) -> None:
        """Count `n` more finished units; write a log line when `interval` seconds passed since the last."""
        with self._lock:
            self.n += n
            if self._bar is not None:
                self._bar.update(n)
                return
            now = time.monotonic()
            if now - self._last >= self.interval:
                self._last = now
                self._write(self.line(now))

    def line(self, now: float | None = None) -> str:
        """The log line for the current count, e.g. "prep cache: 120/1000 items, 35.2 items/s, ETA 25 s"."""
        elapsed = (now if now is not None else time.monotonic()) - self._t0
        rate = self.n / elapsed if elapsed > 0 else 0.0
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        text = f"{self.desc}: {count} {self.unit}, {rate:.1f} {self.unit}/s"
        if self.total is not None and self.n < self.total and rate > 0:
            text += f", ETA {format_duration((self.total - self.n) / rate)}"
        elif self.total is None or self.n >= self.total:
            text += f", {format_duration(elapsed)} elapsed"
        return text

    def _write(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Close the bar, or write the final log line (once)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._bar is not None:
                self._bar.close()
            elif self.n or self.total:  # nothing to do (an up-to-date cache) needs no line
                self._write(self.line())

    def __exit__(self, *exc: object) -> None:
        self.close()
