"""Loader state: where an epoch stands and every random draw made so far, as of the last batch delivered.

The loader reads and transforms batches ahead of the training loop, so the random states of the user's
transforms run ahead of what the user has received. `Draws` snapshots them after each batch's draws (the
folded crop's on the read thread right after its windows, the rest after the tail ran) and puts them back
to the snapshot of the last batch delivered when an epoch is left early or when a state is saved: a batch
read ahead is neither lost nor drawn twice.

A saved state is small JSON (no tensors): version, fingerprints of the cache and of the random transforms,
the epoch's order (seed, shuffle, rank, world, batch size), the position in the epoch and one numpy
random state per random transform.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import hashlib
import math
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loaders.errors import LoaderStateError

__all__ = [
    "VERSION",
    "Cursor",
    "Draws",
    "LoaderStateError",
    "Position",
    "as_state",
    "check",
    "fingerprint",
    "keep_random_states",
    "peeking",
    "randomizables",
]

VERSION = 1
_ORDER = ("batch_size", "drop_last", "n_items", "seed", "shuffle", "rank", "world")  # checked in this order


def randomizables(root: Any) -> list[Any]:
    """Every object under `root` with a numpy random state `R` (nested Composes and the transforms a random
    transform holds, such as RandCropByPosNegLabeld's cropper), each once, in a fixed walk order."""
    out: list[Any] = []
    seen: set[int] = set()

    def walk(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(getattr(obj, "R", None), np.random.RandomState):
            out.append(obj)
        for child in list(getattr(obj, "transforms", None) or []):
            walk(child)
        for name, value in sorted(getattr(obj, "__dict__", {}).items()):
            if name != "transforms" and hasattr(value, "set_random_state"):
                walk(value)

    walk(root)
    return out


@contextlib.contextmanager
def keep_random_states(transform: Any) -> Iterator[None]:
    """Restore the random state of every Randomizable in `transform` on exit. Building a MONAI Compose
    re-seeds what it is built from (so does `Compose.flatten`, which splitting a chain calls): without this,
    `transform.set_random_state(s)` before building a loader or the drop-in would give other draws than
    PersistentDataset with the same seed."""
    states = [(obj, obj.R) for obj in randomizables(transform)]
    try:
        yield
    finally:
        for obj, state in states:
            obj.R = state


@contextlib.contextmanager
def peeking(transform: Any) -> Iterator[None]:
    """Draws made inside are undone on exit: every Randomizable in `transform` gets back its generator and that
    generator its state (a draw may give an object a new generator: MONAI's `set_random_state(seed=)`). What is
    drawn inside is what the same calls draw next, outside."""
    restore = snapshot(transform)
    try:
        yield
    finally:
        restore()


def snapshot(transform: Any) -> Callable[[], None]:
    """A call that puts every Randomizable in `transform` back as it is now: its generator, and that generator's
    state (for draws that may have to be undone, `peeking`'s and a batched step that falls back)."""
    saved = [(obj, obj.R, obj.R.get_state()) for obj in randomizables(transform)]

    def restore() -> None:
        for obj, generator, state in saved:
            obj.R = generator
            generator.set_state(state)

    return restore


_MT_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], int pos
_AUG_OFFSET: list[int] = []  # where a legacy RandomState keeps has_gauss / gauss, past its address (0: unknown)


class _Snapshot:
    """One object's random state as of now, cheaply: the generator's raw bytes read in place.

    get_state costs ~35 us (the state dict built in Python), several times a batch. In place, a legacy
    RandomState's whole state is the Mersenne Twister's words and position (2,500 bytes) and the cached
    Gaussian (`has_gauss`, `gauss`), read with three `string_at`s (~2 us); the bytes turn into the
    `get_state()` tuple only when a state is put back or saved (`as_state`). The same bytes as last time
    give the same object again. Where numpy's memory layout is not the one expected (checked against
    get_state on first use, for each generator), every snapshot is a get_state."""

    __slots__ = ("_r", "_mt", "_aug", "_last")

    def __init__(self) -> None:
        self._r: Any = None
        self._mt = 0  # 0: read the state through get_state only
        self._aug = 0
        self._last: Any = None

    def take(self, r: Any) -> Any:
        if r is not self._r:  # a new generator (set_random_state replaces R): find its bytes again
            self._r, self._last = r, None
            self._mt, self._aug = _addresses(r)
        if not self._mt:
            return r.get_state()
        raw = _read(self._mt, self._aug)
        if raw != self._last:
            self._last = raw
        return self._last


def _read(mt: int, aug: int) -> bytes:
    return ctypes.string_at(mt, _MT_BYTES) + ctypes.string_at(aug + 8, 4) + ctypes.string_at(aug + 16, 8)


def same(a: Mapping[int, Any], b: Mapping[int, Any]) -> bool:
    """Whether two `Draws` snapshots hold the same states (raw bytes or get_state tuples alike)."""
    if a.keys() != b.keys():
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, bytes) and isinstance(y, bytes):
            if x != y:
                return False
        elif not all(np.array_equal(p, q) for p, q in zip(as_state(x), as_state(y))):
            return False
    return True


def as_state(snapshot: Any) -> tuple[Any, ...]:
    """A snapshot (raw bytes from `_Snapshot`, or a get_state tuple) as `RandomState.get_state()` gives it."""
    if isinstance(snapshot, tuple):
        return snapshot
    keys = np.frombuffer(snapshot, dtype="<u4", count=624).astype(np.uint32)
    pos, has_gauss = struct.unpack_from("<ii", snapshot, _MT_BYTES - 4)
    (gauss,) = struct.unpack_from("<d", snapshot, _MT_BYTES + 4)
    return ("MT19937", keys, pos, has_gauss, gauss)


def _addresses(r: Any) -> tuple[int, int]:
    """Addresses of `r`'s Mersenne Twister words and of its Gaussian cache, or (0, 0) where they cannot be
    read in place (another bit generator or class, another numpy layout): checked against get_state."""
    if not isinstance(r, np.random.RandomState):
        return 0, 0
    if not _AUG_OFFSET:
        _AUG_OFFSET.append(_find_aug_offset())
    offset = _AUG_OFFSET[0]
    try:
        mt = int(r._bit_generator.ctypes.state_address)
    except Exception:  # noqa: BLE001  (another bit generator, or a numpy without these attributes)
        return 0, 0
    if not offset or offset + 24 > type(r).__basicsize__:
        return 0, 0
    aug = id(r) + offset
    state: Any = r.get_state()
    if state[0] != "MT19937" or _read(mt, aug) != _raw_of(state):
        return 0, 0
    return mt, aug


def _raw_of(state: tuple[Any, ...]) -> bytes:
    _, keys, pos, has_gauss, gauss = state
    return np.asarray(keys, "<u4").tobytes() + struct.pack("<iid", int(pos), int(has_gauss), float(gauss))


def _find_aug_offset() -> int:
    """Offset of a legacy RandomState's `_aug_state` (bit generator pointer, has_gauss, gauss) past its
    address: the field that points at the object's own `_bitgen`, whose first field points at the Mersenne
    Twister's state. Proven on a probe by setting has_gauss / gauss and reading them back; 0 if not found."""
    probe = np.random.RandomState(0)
    size = type(probe).__basicsize__ // 8 * 8
    try:
        words = np.frombuffer(ctypes.string_at(id(probe), size), dtype=np.uintp)
        target = int(probe._bit_generator.ctypes.state_address)
    except Exception:  # noqa: BLE001
        return 0
    got: Any = probe.get_state()
    keys = got[1]
    for bitgen in np.flatnonzero(words == target):
        for at in np.flatnonzero(words == id(probe) + 8 * int(bitgen)):
            offset = 8 * int(at)
            if offset + 24 > size:
                continue
            fits = True
            for has_gauss, gauss in ((1, 0.8125), (0, 0.0), (1, -2.5)):
                probe.set_state(("MT19937", keys, 624, has_gauss, gauss))
                raw = ctypes.string_at(id(probe) + offset + 8, 4) + ctypes.string_at(id(probe) + offset + 16, 8)
                fits = fits and raw == struct.pack("<id", has_gauss, gauss)
            if fits:
                return offset
    return 0


def _encode(state: tuple[Any, ...]) -> list[Any]:
    name, keys, pos, has_gauss, gauss = state
    return [str(name), base64.b64encode(np.asarray(keys, dtype="<u4").tobytes()).decode(), int(pos),
            int(has_gauss), float(gauss)]  # fmt: skip


def _decode(value: Any, where: str) -> tuple[Any, ...]:
    try:
        name, keys, pos, has_gauss, gauss = value
        words = np.frombuffer(base64.b64decode(str(keys), validate=True), dtype="<u4").astype(np.uint32)
        state = (str(name), words, int(pos), int(has_gauss), float(gauss))
        wrong = _wrong_state(state)
        if wrong:
            raise ValueError(wrong)
        np.random.RandomState().set_state(state)  # refused here, not half-way through a restore
    except (TypeError, ValueError, OverflowError) as exc:
        raise LoaderStateError(f"{where}: a random state is damaged ({exc}); save the state again") from exc
    return state


def _wrong_state(state: tuple[Any, ...]) -> str:
    """What makes a decoded legacy RandomState no state numpy makes ("" when none): numpy's own set_state takes
    a key of all zeros (the twister then draws zeros forever) and a NaN cached gaussian."""
    name, words, pos, has_gauss, gauss = state
    if name != "MT19937" or len(words) != 624:
        return f"a {name[:20]!r} generator of {len(words)} words, not MT19937's 624"
    if not words.any():
        return "its key is all zeros (a generator that draws only zeros)"
    if not 0 <= pos <= 624 or has_gauss not in (0, 1) or not math.isfinite(gauss):
        return f"position {pos}, has_gauss {has_gauss} or gauss {gauss} out of range"
    return ""


class Draws:
    """The random states of `root`'s random transforms, split into those the read thread draws while it
    plans a batch (`early`: the folded crop) and the rest (drawn when the tail runs)."""

    def __init__(self, root: Any, early: Any = None) -> None:
        self.objs = randomizables(root)
        early_ids = {id(o) for o in randomizables(early)} if early is not None else set()
        self.early = [i for i, o in enumerate(self.objs) if id(o) in early_ids]
        self.late = [i for i, o in enumerate(self.objs) if id(o) not in early_ids]
        self._snaps = [_Snapshot() for _ in self.objs]

    def take(self, which: Sequence[int] | None = None) -> dict[int, tuple[Any, ...]]:
        """Snapshot of the objects at positions `which` (all by default)."""
        at = range(len(self.objs)) if which is None else which
        return {i: self._snaps[i].take(self.objs[i].R) for i in at}

    def after(self, early: Mapping[int, tuple[Any, ...]]) -> dict[int, tuple[Any, ...]]:
        """The states as of a batch whose fold drew `early` (taken then) and whose tail has just run."""
        return {**early, **self.take(self.late)}

    def put(self, snap: Mapping[int, tuple[Any, ...]]) -> None:
        """Set the random states back in place. Objects sharing one RandomState stay sharing it where `snap`
        holds one state for them; where it holds two (it was taken where they no longer share one: MONAI's
        `set_random_state(seed=)` gives each its own, as RandSpatialCropSamples' draws do), each gets its own."""
        done: dict[int, Any] = {}  # id of a RandomState set here -> the state it was set to
        for i, state in snap.items():
            obj = self.objs[i]
            if id(obj.R) in done and not same({0: done[id(obj.R)]}, {0: state}):
                obj.R = np.random.RandomState()
            obj.R.set_state(as_state(state))  # the next take reads the bytes set here
            done[id(obj.R)] = state

    def names(self) -> list[str]:
        return [type(o).__name__ for o in self.objs]

    def encode(self, snap: Mapping[int, tuple[Any, ...]]) -> list[list[Any]]:
        return [_encode(as_state(snap[i])) for i in range(len(self.objs))]

    def decode(self, values: Any, where: str) -> dict[int, tuple[Any, ...]]:
        if not isinstance(values, list) or len(values) != len(self.objs):
            raise LoaderStateError(f"{where}: it holds another number of random transforms than this transform")
        return {i: _decode(v, where) for i, v in enumerate(values)}


@dataclass
class Position:
    """Where an epoch stands as of the last batch delivered: the epoch, the batches of it delivered, and every
    random state as of that batch."""

    epoch: int
    batch: int
    snap: dict[int, tuple[Any, ...]]


class Cursor:
    """A loader's delivered-batch cursor: its random transforms' states (`draws`), the position of the epoch
    being iterated (`live`, None between epochs) and, between epochs, the batches of the next epoch delivered
    before a `load_state_dict` (`resume`). Batches read ahead and not delivered leave it where it was."""

    def __init__(self, draws: Draws) -> None:
        self.draws = draws
        self.live: Position | None = None
        self.left: Position | None = None  # where the last epoch was left (whole, or by a `break`)
        self.resume = 0
        self.ahead = False  # the states have moved on past `left` for the next epoch begun ahead (loaders.fast.carry)

    def begin(self, epoch: int, skip: int) -> dict[int, tuple[Any, ...]]:
        """An epoch starts at batch `skip` from the states of now (or, for the epoch begun ahead, of the last
        batch delivered before it); returns them."""
        snap = self.left.snap if self.ahead and self.left is not None else self.draws.take()
        self.left, self.ahead = None, False
        self.live = Position(epoch, skip, snap)
        return self.live.snap

    def delivered(self, epoch: int, batch: int, snap: dict[int, tuple[Any, ...]]) -> None:
        """Batch `batch - 1` of `epoch` reached the caller, its draws as of `snap`."""
        self.live = Position(epoch, batch, snap)

    def end(self, ahead: bool = False) -> None:
        """The epoch is left (whole or early): the states go back to those of the last batch delivered, or, where
        the next epoch was begun `ahead` (its draws being made), stay as they are until it is taken or dropped."""
        if self.live is not None:
            if not ahead:
                self.draws.put(self.live.snap)
            self.left, self.live, self.ahead = self.live, None, ahead

    def drop_ahead(self) -> None:
        """The epoch begun ahead is dropped (its jobs done or cancelled): the states back to the last batch
        delivered."""
        if self.ahead and self.left is not None:
            self.draws.put(self.left.snap)
        self.ahead = False

    def start_at(self, epoch_resume: int, snap: Mapping[int, tuple[Any, ...]]) -> None:
        """The next epoch goes on from its batch `epoch_resume` with the states `snap` (a loaded state, or the
        parent's states in a feeder's child)."""
        self.draws.put(snap)
        self.left, self.resume, self.ahead = None, epoch_resume, False

    def now(self, epoch: int) -> Position:
        """As of the last batch delivered: the live epoch's position; between epochs, where the last one was left
        (a `break` closes the loop's iterator: the state after it is the state inside it) while `epoch` is the
        one after it and no state was set since; else `epoch`'s start."""
        if self.live is not None:
            return self.live
        left = self.left
        follows = left is not None and left.epoch == epoch - 1 and not self.resume
        if left is not None and follows and self.ahead:  # the states are being drawn from: `left` stands
            return left
        snap = self.draws.take()
        if left is not None and follows and same(left.snap, snap):
            return left
        return Position(epoch, self.resume, snap)


def fingerprint(manifest: Mapping[str, Any], names: Sequence[str]) -> str:
    """The cache (its head's fingerprint and generation) and the random transforms a state belongs to."""
    text = "|".join([str(manifest.get("fingerprint")), str(manifest.get("generation")), *names])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def check(state: Any, want: Mapping[str, Any], where: str = "load_state_dict") -> None:
    """LoaderStateError in one line unless `state` is a state of a loader like `want` (same version, cache,
    transforms and order)."""
    if not isinstance(state, Mapping) or state.get("format") != "blockprep-loader-state":
        raise LoaderStateError(f"{where}: not a blockprep loader state (save one with loader.state_dict())")
    if state.get("version") != VERSION:
        raise LoaderStateError(f"{where}: state version {state.get('version')!r}; this blockprep reads {VERSION}")
    if state.get("fingerprint") != want["fingerprint"]:
        raise LoaderStateError(
            f"{where}: the state belongs to another cache or transform (rebuilt cache, or other random "
            "transforms); resume with the loader it was saved from, or start the run afresh"
        )
    for name in _ORDER:
        if state.get(name) != want[name]:
            fix = "resume with the same world size (a state holds one rank's place)" if name in ("rank", "world") \
                else f"build the loader with {name}={state.get(name)!r}"  # fmt: skip
            raise LoaderStateError(f"{where}: the state was saved with {name}={state.get(name)!r}, this loader "
                                   f"has {want[name]!r}; {fix}")  # fmt: skip
    for name in ("epoch", "batch"):
        value = state.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 62:
            raise LoaderStateError(f"{where}: {name} must be a non-negative integer below 2^62, not "
                                   f"{str(value)[:40]!r}; save the state again")  # fmt: skip
