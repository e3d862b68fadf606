"""Where the time to a loader's first batch goes: every thread of this process sampled while `PreparedLoader` is
built and hands over its first batch, once with each feeder setting (`profile_train --first-batch`)."""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

INTERVAL_S = 0.002  # between samples; each sample is weighted by the time that actually passed since the last
# a thread whose innermost frame is one of these waits (a lock, an executor's queue, a socket): not counted
IDLE = {("threading.py", "wait"), ("thread.py", "_worker"), ("queue.py", "get"), ("connection.py", "accept"),
        ("socket.py", "accept"), ("connection.py", "_recv"), ("selectors.py", "select")}  # fmt: skip


class Sampler:
    """Every thread's Python stack every INTERVAL_S, on a thread of its own: seconds per (thread, frame)."""

    def __init__(self) -> None:
        self.inclusive: dict[tuple[str, str], float] = defaultdict(float)
        self.leaf: dict[tuple[str, str], float] = defaultdict(float)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="first-batch-sampler")

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        names = {t.ident: t.name for t in threading.enumerate() if t.ident is not None}
        last = time.perf_counter()
        while not self._stop.wait(INTERVAL_S):
            now = time.perf_counter()
            dt, last = now - last, now
            for ident, frame in sys._current_frames().items():
                if ident == threading.get_ident():
                    continue
                if (Path(frame.f_code.co_filename).name, frame.f_code.co_name) in IDLE:
                    continue
                name = names.get(ident) or _name(ident, names)
                seen: set[str] = set()
                at: Any = frame
                while at is not None:
                    seen.add(f"{Path(at.f_code.co_filename).name}:{at.f_lineno if at is frame else ''}"
                             f"{at.f_code.co_name}")  # fmt: skip
                    at = at.f_back
                for where in seen:
                    self.inclusive[(name, where)] += dt
                line = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} {frame.f_code.co_name}"
                self.leaf[(name, line)] += dt

    def report(self, rows: int) -> str:
        lines = ["  inclusive s | thread | frame"]
        lines += [f"  {s:9.3f} | {t} | {w}" for (t, w), s in _top(self.inclusive, rows)]
        lines += ["  leaf s | thread | line"]
        lines += [f"  {s:9.3f} | {t} | {w}" for (t, w), s in _top(self.leaf, rows)]
        return "\n".join(lines)


def _top(seconds: dict[tuple[str, str], float], rows: int) -> list[tuple[tuple[str, str], float]]:
    return sorted(seconds.items(), key=lambda kv: -kv[1])[:rows]


def _name(ident: int, names: dict[int, str]) -> str:
    """A thread started after sampling began, named once seen."""
    names.update({t.ident: t.name for t in threading.enumerate() if t.ident is not None})
    return names.get(ident, str(ident))


def first_batch(
    cache: Path, transform: Callable[[], Any], batch: int, device: str, rows: int, feeders: list[Any] | None = None
) -> int:
    """Print, per feeder setting, the seconds to build the loader and to its first batch, and where they went
    (in one process a later setting finds the pinned memory an earlier one freed in torch's cache: one a process
    times each from scratch)."""
    import torch

    from loaders.fast.loader import PreparedLoader

    gpu = device.startswith("cuda")
    if gpu:
        torch.ones(1, device=device).sum().item()  # the training process's CUDA context exists, as in a training run
    for feeder in feeders or (("auto", False) if gpu else (True, False)):
        chain = transform()  # the user's, made before the loader: not the loader's time
        with Sampler() as sampler:
            t0 = time.perf_counter()
            loader = PreparedLoader(cache, chain, batch, device=device, seed=0, feeder=feeder)
            t1 = time.perf_counter()
            got = next(iter(loader))
            if gpu:
                torch.cuda.synchronize()
            t2 = time.perf_counter()
        print(f"feeder={feeder!r}: built in {t1 - t0:.3f} s, first batch {t2 - t1:.3f} s after "
              f"({sorted(got)}); feeder pid {loader.feeder_pid}", flush=True)  # fmt: skip
        print(sampler.report(rows), flush=True)
        loader.close()
    return 0
