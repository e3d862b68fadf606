"""Where a training step's time goes on the training process's host, phase by phase: with the feeder's batches,
with batches made in this process, and on one resident batch (the ceiling's step), all in one process.

    python -m workflows.bench.profile_train --workload seg-aug --phases --steps 60 --device cuda:0

Each step runs as the training benchmark runs it: the batch taken (`next`), the training stream synced, the step's
launches, the stream synced again. A resident row runs before and after each loader's row, because the ceiling's
step moves within one process. Beside the feeder, the hand-over's own calls in this process are timed too:
receiving a batch's message (there already, or waited for; its unpickling; its size), copying the batch out of the
ring.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Phases:
    """Means per step, in ms."""

    steps: int
    taking: float  # next(): the batch handed over
    synced: float  # the batch on the device, the training stream synced
    launching: float  # the step's host work: forward, backward, optimiser (launches)
    finishing: float  # the training stream synced after the step: the GPU's work left

    @property
    def total(self) -> float:
        return self.taking + self.synced + self.launching + self.finishing


def timed_steps(batches: Iterator[tuple[Any, Any]], step: Callable[[Any, Any], Any], sync: Callable[[], Any],
                n: int, marks: list[tuple[float, ...]] | None = None) -> Phases:  # fmt: skip
    """n steps from `batches`, each phase timed (each step's five instants appended to `marks` where given)."""
    sums = [0.0] * 4
    for _ in range(n):
        t0 = time.perf_counter()
        image, label = next(batches)
        t1 = time.perf_counter()
        sync()
        t2 = time.perf_counter()
        step(image, label)
        t3 = time.perf_counter()
        sync()
        t4 = time.perf_counter()
        if marks is not None:
            marks.append((t0, t1, t2, t3, t4))
        for i, (a, b) in enumerate(((t0, t1), (t1, t2), (t2, t3), (t3, t4))):
            sums[i] += b - a
    return Phases(n, *(1e3 * s / max(1, n) for s in sums))


@contextlib.contextmanager
def handover_calls() -> Iterator[dict[str, tuple[float, float, int]]]:
    """The feeder's hand-over calls in this process timed while inside: name -> (ms a call: mean, median; calls),
    filled at the end. A message's receipt is told apart by whether the message was there already ("recv, there":
    the hand-over's own cost) or was waited for ("recv, waited": the child behind); "loads" is its unpickling
    alone, "message KB" its size (KB: mean, median; messages)."""
    from loaders.fast import feeder

    samples: dict[str, list[float]] = defaultdict(list)
    out: dict[str, tuple[float, float, int]] = {}

    def timing(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
            key = name
            if name == "recv":
                key = "recv, there" if self._conn.poll() else "recv, waited"
            t = time.perf_counter()
            try:
                return f(self, *args, **kwargs)
            finally:
                samples[key].append(1e3 * (time.perf_counter() - t))

        return wrapped

    def sized(data: bytes) -> Any:
        samples["message KB"].append(len(data) / 1e3)
        t = time.perf_counter()
        try:
            return loads(data)
        finally:
            samples["loads"].append(1e3 * (time.perf_counter() - t))

    loads = feeder.loads
    methods = {name: getattr(feeder.Feeder, name) for name in ("_recv", "_unpack", "_send")}
    for name, f in methods.items():
        setattr(feeder.Feeder, name, timing(name.lstrip("_"), f))
    feeder.loads = sized  # type: ignore[assignment]
    try:
        yield out
    finally:
        for name, f in methods.items():
            setattr(feeder.Feeder, name, f)
        feeder.loads = loads  # type: ignore[assignment]
        out.update({k: (statistics.fmean(v), statistics.median(v), len(v)) for k, v in samples.items()})


@contextlib.contextmanager
def take_spans() -> Iterator[list[tuple[float, float, bool]]]:
    """The feeder's takes of a batch (`Feeder._take`: its message, its copies up, its tail's launches) while inside:
    (start, end, on a thread other than the caller's) each."""
    import threading

    from loaders.fast import feeder

    spans: list[tuple[float, float, bool]] = []
    take = feeder.Feeder._take
    caller = threading.get_ident()

    def timed(self: Any, *args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return take(self, *args, **kwargs)
        finally:
            spans.append((t, time.perf_counter(), threading.get_ident() != caller))

    feeder.Feeder._take = timed  # type: ignore[method-assign]
    try:
        yield spans
    finally:
        feeder.Feeder._take = take  # type: ignore[method-assign]


@contextlib.contextmanager
def take_parts() -> Iterator[dict[str, float]]:
    """Seconds spent while inside in each part of a host feeder's take (its message received, its slot's views, the
    draws made on the device, the graphs' launches with the captures among them, the captures, the eager steps),
    by name; "takes" counts the takes."""
    from loaders.fast import feeder, hostfeed
    from loaders.tail import replay

    parts = {"message": (feeder.Feeder, "_recv"), "slot views": (hostfeed.HostSlots, "views"),
             "made on the device": (replay, "_made"), "launches": (replay._Chain, "_launch"),
             "captures": (replay._Chain, "_capture"), "eager steps": (replay._Chain, "_eager_step"),
             "takes": (feeder.Feeder, "_take")}  # fmt: skip
    spent = dict.fromkeys(parts, 0.0)
    kept = {name: getattr(owner, attr) for name, (owner, attr) in parts.items()}

    def timing(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return f(*args, **kwargs)
            finally:
                spent[name] += 1.0 if name == "takes" else time.perf_counter() - t

        return timed

    for name, (owner, attr) in parts.items():
        setattr(owner, attr, timing(name, kept[name]))
    try:
        yield spent
    finally:
        for name, (owner, attr) in parts.items():
            setattr(owner, attr, kept[name])


def parts_said(spent: dict[str, float]) -> str:
    """`take_parts`' seconds as ms a take."""
    n = spent.get("takes", 0.0)
    if not n:
        return "no take's parts timed"
    return "ms a take: " + ", ".join(f"{k} {1e3 * v / n:.2f}" for k, v in spent.items() if k != "takes")


def takes_said(marks: list[tuple[float, ...]], spans: list[tuple[float, float, bool]], captures: int) -> str:
    """Where the takes ran against the steps' phases (ms a step of takes within each), how long each took, and the
    tail's graphs captured a step."""
    if not marks or not spans:
        return "no takes timed"
    names = ("next", "synced", "launches", "synced after", "between")
    within = [0.0] * 5
    for a, b, _ in spans:
        for m, nxt in zip(marks, [*marks[1:], None]):
            edges = [*m, nxt[0] if nxt else m[4]]
            for i in range(5):
                within[i] += max(0.0, min(b, edges[i + 1]) - max(a, edges[i]))
    took = sorted(1e3 * (b - a) for a, b, _ in spans)
    n = len(marks)
    where = "a thread" if any(t for *_, t in spans) else "the caller's thread"
    return (f"takes ({len(spans)}, on {where}): ms a take mean {statistics.fmean(took):.2f}, median "
            f"{took[len(took) // 2]:.2f}, max {took[-1]:.2f}; ms a step of takes within " + ", ".join(
                f"{name} {1e3 * w / n:.2f}" for name, w in zip(names, within)) +
            f"; graphs captured a step {captures / n:.2f}")  # fmt: skip


def _captures(loader: Any) -> int:
    replay = getattr(getattr(getattr(loader, "assembly", None), "tail", None), "_replay", None)
    return int(getattr(replay, "captures", 0) or 0)


def endless(loader: Any, device: str) -> Generator[tuple[Any, Any], None, None]:
    """(image, label) on `device`, epoch after epoch of `loader`."""
    from workflows.bench.train_loop import on_device

    while True:
        for b in loader:
            yield on_device(b["image"], device), on_device(b["label"], device)


def phases(loaders: dict[str, Callable[[], Any]], step: Callable[[Any, Any], Any], device: str, steps: int) -> None:
    """Print each loader's phases (`loaders`: name -> a function that builds it), a resident batch's before and
    after each."""
    import torch

    sync = torch.cuda.current_stream(device).synchronize if device.startswith("cuda") else (lambda: None)
    print("per step, ms:  all  next (the batch)  synced  the step's launches  synced after")
    for name, build in loaders.items():
        loader = build()
        loader.wait_feeder()  # the feeder's batches (where it has one), not this process's while it starts

        feed = endless(loader, device)
        timed_steps(feed, step, sync, max(steps // 2, len(loader)))  # warm: the tier fills, kernels compile
        resident = next(feed)
        same = itertools.repeat(resident)
        _show("resident batch", timed_steps(same, step, sync, steps))
        marks: list[tuple[float, ...]] = []
        before = _captures(loader)
        with handover_calls() as calls, take_spans() as spans, take_parts() as parts:
            row = timed_steps(feed, step, sync, steps, marks)
        captured = _captures(loader) - before
        _show(f"{name} (batches made by {loader.feeder_pid or 'this process'})", row)
        _show("resident batch again", timed_steps(same, step, sync, steps))
        if calls:
            print("  the hand-over's calls here (ms a call: mean/median, calls): " + ", ".join(
                f"{k} {v:.3f}/{m:.3f} ({n})" for k, (v, m, n) in calls.items()))  # fmt: skip
            print(f"  {_states_said(loader)}")
            print(f"  {takes_said(marks, spans, captured)}")
            print(f"  {parts_said(parts)}")
        feed.close()
        loader.close()


def _states_said(loader: Any) -> str:
    """How the batches' random states came: read in place as raw bytes, or as numpy's `get_state()` tuples (where
    this numpy's layout was not the expected one: slower to take, and to send in each batch's message)."""
    live = getattr(loader.cursor, "live", None)
    snap = live.snap if live is not None else {}
    raw = sum(isinstance(v, bytes) for v in snap.values())
    return f"random states a batch: {len(snap)}, of them read in place as raw bytes: {raw}"


def _show(name: str, p: Phases) -> None:
    print(f"{name} ({p.steps} steps): {p.total:.2f}  {p.taking:.2f}  {p.synced:.2f}  {p.launching:.2f}  "
          f"{p.finishing:.2f}")  # fmt: skip
