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
import ctypes
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from loaders.errors import LoaderStateError

__all__ = ["VERSION", "Draws", "LoaderStateError", "check", "fingerprint", "randomizables"]

VERSION = 1
_ORDER = ("seed", "shuffle", "rank", "world", "batch_size", "drop_last", "n_items")


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


_MT_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624], int pos


class _Snapshot:
    """One object's last `RandomState.get_state()`, given again while its generator has drawn nothing since.

    get_state costs ~35 us (the state dict built in Python), a few times a batch; a chain's Composes and
    outer dict transforms often never draw. "Drawn nothing" is told exactly from the generator's raw
    Mersenne Twister words and position (2,500 bytes read in place) while the snapshot holds no cached
    Gaussian: a legacy `normal` may use a cached one without moving the position, and a new cached one is
    only ever made by drawing words. Where numpy's memory layout is not the one expected (checked against
    get_state on first use), every snapshot is a get_state."""

    __slots__ = ("_r", "_address", "_raw", "_state")

    def __init__(self) -> None:
        self._r: Any = None
        self._address = 0  # 0: read the state through get_state only
        self._raw = b""
        self._state: tuple[Any, ...] = ()

    def forget(self) -> None:
        """The generator was set from outside: the next take reads it whole."""
        self._raw = b""

    def take(self, r: Any) -> tuple[Any, ...]:
        if r is not self._r:  # a new generator (set_random_state replaces R): find its words again
            self._r, self._raw = r, b""
            self._address = _state_address(r)
        if self._address:
            raw = ctypes.string_at(self._address, _MT_BYTES)
            if raw == self._raw:
                return self._state
        state = r.get_state()
        if self._address:
            # the words as get_state saw them; a snapshot holding a cached Gaussian is never given again
            self._raw = raw if not state[3] and ctypes.string_at(self._address, _MT_BYTES) == raw else b""
        self._state = state
        return state


def _state_address(r: Any) -> int:
    """Address of `r`'s Mersenne Twister words and position, or 0 where they cannot be read in place."""
    try:
        address = int(r._bit_generator.ctypes.state_address)
        state = r.get_state()
        raw = ctypes.string_at(address, _MT_BYTES)
    except Exception:  # noqa: BLE001  (another bit generator, or a numpy without these attributes)
        return 0
    if state[0] != "MT19937" or raw != np.asarray(state[1], "<u4").tobytes() + int(state[2]).to_bytes(4, "little"):
        return 0
    return address


def _encode(state: tuple[Any, ...]) -> list[Any]:
    name, keys, pos, has_gauss, gauss = state
    return [str(name), base64.b64encode(np.asarray(keys, dtype="<u4").tobytes()).decode(), int(pos),
            int(has_gauss), float(gauss)]  # fmt: skip


def _decode(value: Any, where: str) -> tuple[Any, ...]:
    try:
        name, keys, pos, has_gauss, gauss = value
        words = np.frombuffer(base64.b64decode(str(keys), validate=True), dtype="<u4").astype(np.uint32)
        state = (str(name), words, int(pos), int(has_gauss), float(gauss))
        np.random.RandomState().set_state(state)  # refused here, not half-way through a restore
    except (TypeError, ValueError) as exc:
        raise LoaderStateError(f"{where}: a random state is damaged ({exc}); save the state again") from exc
    return state


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
        """Set the random states back in place (objects sharing one RandomState stay sharing it)."""
        for i, state in snap.items():
            self.objs[i].R.set_state(state)
            self._snaps[i].forget()  # the same words may now come with another cached Gaussian

    def names(self) -> list[str]:
        return [type(o).__name__ for o in self.objs]

    def encode(self, snap: Mapping[int, tuple[Any, ...]]) -> list[list[Any]]:
        return [_encode(snap[i]) for i in range(len(self.objs))]

    def decode(self, values: Any, where: str) -> dict[int, tuple[Any, ...]]:
        if not isinstance(values, list) or len(values) != len(self.objs):
            raise LoaderStateError(f"{where}: it holds another number of random transforms than this transform")
        return {i: _decode(v, where) for i, v in enumerate(values)}


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
        if not isinstance(state.get(name), int) or isinstance(state.get(name), bool) or state[name] < 0:
            raise LoaderStateError(f"{where}: {name} must be a non-negative integer, not {state.get(name)!r}")
