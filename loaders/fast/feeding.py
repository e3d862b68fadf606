"""The feeder's side of `PreparedLoader` (`feeder=True` / `"auto"`): the child started with the loader's arguments,
the batches made in this process while it starts and handed over at a batch boundary, the device tier lent to it,
and `feeder="auto"`'s verdict (`loaders.fast.trial`). The child's end is `loaders.fast.child`, the messages
`loaders.fast.feeder`.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from typing import Any

import numpy as np

from loaders import tunables
from loaders.errors import ArgumentTypeError, ArgumentValueError
from loaders.fast.trial import DEVICE, HERE, HOST, FeederTrial, host_at_start
from loaders.tunables import TIER_SHARE_TENSORS


class FeederSide:
    """`PreparedLoader`'s feeder methods (a base class: the loader's own attributes, declared here)."""

    torch: Any
    cache: Any
    device: Any
    gpu: bool
    budget: int
    tier: Any
    assembly: Any
    tail_thread: bool
    made_here: int
    _feeder: Any
    _feeder_auto: bool
    _host_feed: bool = False
    _child_spec: dict[str, Any] | None = None  # the first child's arguments (a host feeder's made from them)
    _choosing: bool = False  # the first child's kind chosen by the first periods (`trial.host_at_start`)
    _periods: list[float] | None = None  # the training loop's periods with the batches made here, until chosen
    _periods_of: tuple[int, bool] = (-1, False)  # the epoch they are of, and whether one before it was made here
    _drawable: bool | None = None  # whether the first batch's tail could be replayed here (`BatchedTail.drawable`)
    _tail_default: bool
    _trial: FeederTrial | None
    _verdict: str | None
    _run: Callable[..., Generator[dict[str, Any], None, None]]
    _on_device: Callable[[], Any]

    def _start_feeder(self, payload: bytes) -> None:
        """The feeder's child started with the loader's arguments (it builds its loader while this one goes on)."""
        import weakref

        from loaders.fast.feeder import Feeder

        self._feeder = Feeder(payload)
        weakref.finalize(self, self._feeder.close)

    def _feeder_payload(self, given: dict[str, Any]) -> bytes | None:
        """The feeder child's arguments (loaders.fast.feeder) when this loader's batches are made in a process of their
        own: feeder=True (a reason it cannot, one line), or "auto" on a CUDA device where it can."""
        from loaders.fast.feeder import FeederError, payload

        auto = isinstance(given["feeder"], str)
        if given["workers"] and given["feeder"] is True:
            raise ArgumentValueError("PreparedLoader(feeder=True, workers=...): the batches are made by the workers; "
                                     "pass one of the two")  # fmt: skip
        if not (self.gpu if auto else given["feeder"]) or given["workers"]:
            return None
        if not isinstance(given["backend"], str):
            if auto:
                return None
            raise ArgumentTypeError("PreparedLoader(feeder=True): pass the backend by name (a Backend object "
                                    "stays in this process)")  # fmt: skip
        names = ("cache_dir", "transform", "batch_size", "gpu_budget", "shuffle", "seed", "drop_last", "crop_read",
                 "prefetch", "backend", "backend_options", "keys", "verify", "tail_thread", "switch_interval",
                 "copy_threads", "torch_threads")  # fmt: skip
        spec = {name: given[name] for name in names}
        # the budget as resolved here: the child's own "auto" would count this process's tier as used memory
        spec.update(cache_dir=str(self.cache.root), device=str(self.device), feeder=False, gpu_budget=self.budget)
        self._child_spec = spec
        if tunables.HOST_FEED is True:  # the child on the CPU, the tail replayed here (`loaders.fast.hostfeed`)
            spec = _host(spec, self.device)
        self._choosing = tunables.HOST_FEED == "chosen" and auto and self.gpu
        self._periods = []
        self._host_feed = bool(spec.get("host_feed"))
        try:
            return payload(spec)
        except FeederError:
            if auto:  # a lock or an open file in the transform: the same batches, made here
                return None
            raise

    def _on_trial(self, batches: Iterator[dict[str, Any]], trial: FeederTrial) -> Iterator[dict[str, Any]]:
        """feeder="auto": the epoch's batches timed where they were made (`loaders.fast.trial`); at its end, what
        the trial asks: the batches back to this process for good, a host feeder's child tried, or the first child
        started again."""
        yield from trial.watch(batches, lambda: self.made_here)
        if trial.host and trial.first is None and not self._host_replays():
            trial.host = False  # its child would run the tail on its CPU: no match for one with a device
        move = trial.decide()
        if move == HERE:
            self._feeder_back()
        elif move in (HOST, DEVICE):
            self._feeder_swap(host=move == HOST)
        if trial.verdict is not None:
            self._trial, self._verdict = None, trial.verdict

    def _feeder_back(self) -> None:
        """The batches made in this process from the next epoch on (the random states are this process's already:
        the cursor put them back at the epoch's end); the child closed, this process's tier as it lent it (or, where
        it was given up, filled again)."""
        feeder, self._feeder = self._feeder, None
        if feeder is not None:
            feeder.close()
        self.tier.budget = self.budget
        self.tail_thread = self.tail_thread or self._tail_default
        self._host_feed = False

    def _feeder_swap(self, host: bool) -> None:
        """The child closed and another started in its place (a host feeder's, or one with a CUDA context): this
        process makes the batches while it starts, as at the loader's start (`_until_fed`)."""
        from loaders.fast.feeder import payload

        assert self._child_spec is not None
        self._feeder_back()
        spec = _host(self._child_spec, self.device) if host else self._child_spec
        self._host_feed = host
        self._start_feeder(payload(spec))

    def _tier_to_feeder(self) -> None:
        """The device tier this process filled while the child started, lent to the child as it takes over (kept
        here, opened there through CUDA IPC: the child's tier starts full, and it is still here if the batches
        come back); where it holds too many tensors to send, given up (its memory back to the device, for the
        child's own tier: the same budget, not twice)."""
        if self.tier.budget == 0 or self._host_feed:  # a host feeder's child has no device: the tier stays here
            return
        if self.gpu and self.tier.shareable(TIER_SHARE_TENSORS):
            self._feeder.lend_tier(self.tier.items)
            self.tier.budget = 0  # nothing added here while the child makes the batches
            return
        self.tier.clear()
        self.tier.budget = 0
        if self.gpu:
            with self._on_device():
                self.torch.cuda.empty_cache()

    def _until_fed(self, chunks: list[np.ndarray], epoch: int, skip: int) -> Iterator[dict[str, Any]]:
        """While the feeder's child starts (its imports and its loader: seconds), this process makes the batches;
        at the first batch boundary after the child is ready, the rest of the epoch is the child's, from the
        random states as of the last batch delivered: the same batches either way. A child that could not start
        leaves every batch to this process (feeder="auto": said once, with why; feeder=True raises)."""
        import time

        k = skip
        here = self._run(chunks, epoch, skip, self.tail_thread or self._tail_default)
        last = None
        if self._choosing and not self._periods_of[1] and self._periods_of[0] != epoch:
            later = self._periods_of[0] >= 0  # from the second epoch made here on, its periods alone
            self._periods, self._periods_of = [] if later else self._periods, (epoch, later)
        try:
            for batch in here:
                k += 1
                self.made_here += 1
                if self._feeder is not None:  # the child's CUDA context made after this first batch, not during it
                    self._feeder_go()
                yield batch
                now = time.perf_counter()
                if last is not None and self._choosing and self._periods is not None:
                    self._periods.append(now - last)
                last = now
                if k < len(chunks) and self._feeder_ready():
                    break
            else:
                return
        finally:
            here.close()  # the batches read ahead here are dropped, their draws undone (`Cursor.end`)
        self._tier_to_feeder()
        yield from self._feeder.run(self, epoch, k, len(chunks))

    def _feeder_go(self) -> None:
        """The child told to build its loader: at once; or, where its kind is chosen (`loaders.tunables.HOST_FEED`
        "chosen"), once the training loop's first periods with the batches made here tell which
        (`trial.host_at_start`): a host feeder's child where its tail is drawable and the step is long."""
        if not self._choosing:
            self._feeder.go()
            return
        if self._drawable is None:  # the first batch's tail tells, once
            drawable = getattr(self.assembly.tail, "drawable", None)
            self._drawable = drawable() if drawable is not None else False
        host = host_at_start(self._periods or [], self._drawable, self._periods_of[1])
        if host is None:
            return
        self._choosing, self._periods = False, None
        if host and self.gpu and self.device.index not in (None, self.torch.cuda.current_device()):
            host = False  # a loader on a GPU other than this process's current one: a CUDA child, as shown there
        if not host:
            self._feeder.go()
        elif self._feeder.go(_host_args(self.device)):
            self._host_feed = True

    def wait_feeder(self) -> None:
        """Wait until the feeder's child makes the batches (it starts beside the training: its imports and its
        loader, seconds); at once without a feeder. Until then this process makes them, so nothing needs it;
        a benchmark of a long run's steady state does. feeder="auto": a child that could not start is said
        once and the batches stay here; a child not yet told its kind is one with a CUDA context (no periods
        made here to choose by: `_feeder_go`)."""
        import time

        self._choosing = False  # the child waited for before the periods could tell: the first kind
        while self._feeder is not None:
            self._feeder.go()  # a child started in a failed one's place is told too
            if self._feeder_ready():
                return
            time.sleep(0.02)

    def _feeder_ready(self) -> bool:
        """Whether the feeder's child is ready, without waiting. feeder="auto": a child that could not start or
        build its loader is closed and this process makes the batches from now on (said once, with why)."""
        import warnings

        from loaders.fast.feeder import FeederError

        try:
            return bool(self._feeder.poll_ready())
        except FeederError as exc:
            if not self._feeder_auto:
                raise
            trial = self._trial
            if trial is not None and trial.first is not None:  # a host feeder's child: the first choice back
                warnings.warn(f"{exc}; the host feeder is not tried", RuntimeWarning, stacklevel=3)
                self._trial, self._verdict = None, f"{trial.first[2]}; a host feeder's child could not start"
                if trial.first[0] == DEVICE:
                    self._feeder_swap(host=False)  # the first kind of child started again
                else:
                    self._feeder_back()
                return False
            warnings.warn(f"{exc}; the batches are made in this process instead", RuntimeWarning, stacklevel=3)
            self._feeder.close()
            self._feeder = None
            self.tail_thread = self.tail_thread or self._tail_default
            if trial is not None:  # nothing left to compare
                self._trial, self._verdict = None, f"batches made in this process: {exc}"
            return False

    def _host_candidate(self) -> bool:
        """feeder="auto" on a GPU: whether a host feeder's child is tried after the first (BLOCKPREP_HOST_FEED)."""
        return self._child_spec is not None and tunables.HOST_FEED == "auto" and self._feeder_auto and self.gpu

    def _host_replays(self) -> bool:
        """Whether a host feeder's batches would have their tails replayed here, as the first batch made here tells
        (`BatchedTail.drawable`); True where no batch was made here to tell."""
        drawable = getattr(self.assembly.tail, "drawable", None)
        return drawable is None or drawable() is not False

    @property
    def feeder_verdict(self) -> str | None:
        """feeder="auto": where the batches are made after comparing both (`loaders.fast.trial`), with the two
        loop periods measured; None before that (or with no feeder)."""
        return self._verdict

    @property
    def feeder_kind(self) -> str | None:
        """The kind of child making this loader's batches: "host" (`loaders.fast.hostfeed`), "device" (its own
        CUDA context, or its CPU on a CPU loader), or None (the batches made in this process)."""
        if self._feeder is None:
            return None
        return "host" if self._host_feed else "device"

    @property
    def feeder_pid(self) -> int | None:
        """The process making this loader's batches where it is not this one (`feeder`), else None."""
        return self._feeder.pid if self._feeder is not None else None


def _host(spec: dict[str, Any], device: Any) -> dict[str, Any]:
    """A feeder child's arguments made a host feeder's (`loaders.fast.hostfeed`)."""
    return {**spec, **_host_args(device)}


def _host_args(device: Any) -> dict[str, Any]:
    """What makes a feeder child a host feeder, for a loader on `device`."""
    return {"host_feed": True, "device_draws": _device_draws(device)}


def _device_draws(device: Any) -> bool:
    """Whether a host feeder's child describes its large uniform draws for this process to make on `device`
    (`loaders.tail.uniforms`): where BLOCKPREP_DEVICE_DRAWS=1 and cupy is installed; its kernel's check is begun
    here (numpy's draw where it fails)."""
    import importlib.util

    from loaders.tail import uniforms

    if tunables.DEVICE_DRAWS is not True or importlib.util.find_spec("cupy") is None:
        return False
    uniforms.ready(device)
    return True
