"""The transform chain's head/tail split and the head's fingerprint: the ONE definition.

`prep cache` stores the output of the deterministic head; the loaders apply the random tail at training
time and check the fingerprint recorded in the manifest. Both sides call these functions, so they can never
disagree.

The head ends where MONAI's `PersistentDataset` ends it: at the first transform that is random
(`RandomizableTrait`) or is not a MONAI `Transform` at all (a plain function or lambda may draw random
numbers, so it is never cached). Wrap deterministic code of your own in a `monai.transforms.MapTransform`
subclass to have it cached.

The fingerprint hashes each head transform's class and configuration (the attributes its constructor
sets), never state it gains with use (a reader's last `filenames`, random state, thread-local tracing).
Library versions are not part of it: `compare_versions` applies a documented rule instead, so a cache made
on a CPU node (`torch 2.13.0+cpu`) is read on a GPU node (`torch 2.13.0+cu130`).

Light at import: MONAI, torch and numpy are imported inside the functions.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import json
import textwrap
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from loaders.cache.dtypes import dtype_name, to_numpy
from loaders.errors import StaleError

# Attribute names that hold random state or per-call scratch, never configuration.
_SKIP_ATTRS = frozenset({"R", "_do_transform", "_rand_state", "rand_state", "_seed"})
_MAX_DEPTH = 6


class VersionWarning(UserWarning):
    """A library differs from the one the cache was made with in a way that should not change its tensors."""


def _flat_transforms(transform: Any) -> list[Any]:
    """The transforms of a Compose (nested plain Composes flattened) or a list, in order.

    Only exact `Compose` instances are flattened: OneOf, SomeOf and RandomOrder are Compose subclasses whose
    meaning is the choice among their members, so they stay one (random) transform.
    """
    from monai.transforms import Compose

    if isinstance(transform, Compose):
        return list(transform.flatten().transforms)
    if isinstance(transform, (list, tuple)):
        out: list[Any] = []
        for t in transform:
            out.extend(_flat_transforms(t) if type(t) is Compose or isinstance(t, (list, tuple)) else [t])
        return out
    return [transform]


def head_end(transforms: Sequence[Any]) -> tuple[int, str]:
    """(index of the first transform the cache must not run, why): MONAI PersistentDataset's rule."""
    from monai.transforms import RandomizableTrait, Transform

    for i, t in enumerate(transforms):
        name = t.__name__ if inspect.isfunction(t) else type(t).__name__
        if isinstance(t, RandomizableTrait):
            return i, f"head ends before transform {i} ({name}): it is random"
        if not isinstance(t, Transform):
            return i, (
                f"head ends before transform {i} ({name}): not a MONAI Transform, so it may be random; "
                "subclass monai.transforms.MapTransform to cache it"
            )
    return len(transforms), "no random transform: the whole chain is cached"


def split(transform: Any) -> tuple[list[Any], list[Any]]:
    """Split a Compose (or list) into (head, tail) at `head_end`."""
    transforms = _flat_transforms(transform)
    end, _ = head_end(transforms)
    return transforms[:end], transforms[end:]


def split_reason(transform: Any) -> str:
    """Why `split` ends the head where it does, in one line for summaries."""
    return head_end(_flat_transforms(transform))[1]


def _device_of(t: Any) -> str | None:
    """The device a transform puts its outputs on (EnsureTyped, ToDeviced, ToTensord hold it in their array
    converter; others may hold it themselves), or None where it leaves them where they are."""
    for holder in (t, getattr(t, "converter", None)):
        device = getattr(holder, "device", None)
        if device is not None and not callable(device):
            return str(device)
    return None


def head_device(head: Iterable[Any]) -> str | None:
    """Where the head's output tensors live: the device of its last device-setting transform (None: where
    the reader put them, the CPU). A head ending `EnsureTyped(device="cuda:0"), Spacingd(...)` gives
    "cuda:0", as MONAI's PersistentDataset gives its tensors back on the device they were saved from."""
    device = None
    for t in _flat_transforms(list(head)):
        device = _device_of(t) or device
    return device


def touches_cuda(head: Iterable[Any], depth: int = 3) -> bool:
    """True when any transform of the head, or an object it holds (to `depth` levels), names a CUDA device:
    running it initialises CUDA, so it must never run in a process forked after that."""

    def names_cuda(obj: Any, level: int) -> bool:
        device = getattr(obj, "device", None)
        if device is not None and not callable(device) and str(device).startswith("cuda"):
            return True
        if level >= depth or not hasattr(obj, "__dict__"):
            return False
        held = [v for v in vars(obj).values() if hasattr(v, "__dict__") and not isinstance(v, type)]
        return any(names_cuda(v, level + 1) for v in held)

    return any(names_cuda(t, 0) for t in _flat_transforms(list(head)))


def track_meta_switch(transform: Any, depth: int = 3) -> str | None:
    """The name of a transform in `transform` (or an object one holds, to `depth` levels, OneOf's members too)
    whose code sets MONAI's process-wide `set_track_meta` (MONAI before 1.6: RandSimulateLowResolution turns
    it off while it resizes): run on a thread beside the caller's, it makes the caller's own MONAI calls give
    plain tensors meanwhile. None where none does. Flattening builds a MONAI Compose, which re-seeds the
    transforms: callers keep their random states (`loaders.state.keep_random_states`)."""

    def switches(obj: Any, level: int) -> str | None:
        if _sets_track_meta(type(obj)):
            return type(obj).__name__
        if level >= depth or not hasattr(obj, "__dict__"):
            return None
        held = [v for v in vars(obj).values() if not isinstance(v, type)]
        held = [x for v in held for x in (v if isinstance(v, (list, tuple)) else [v]) if hasattr(x, "__dict__")]
        return next((name for v in held if (name := switches(v, level + 1)) is not None), None)

    return next((name for t in _flat_transforms(transform) if (name := switches(t, 0)) is not None), None)


def _sets_track_meta(cls: type) -> bool:
    """Whether a method of `cls` (its own or inherited, outside builtins) calls `set_track_meta` (kept per class)."""
    found = _SETS_TRACK_META.get(cls)
    if found is None:
        found = _SETS_TRACK_META[cls] = any(
            inspect.isfunction(member) and _calls(member, "set_track_meta")
            for klass in cls.__mro__
            if klass.__module__ not in ("builtins", "torch", "numpy")
            for member in vars(klass).values()
        )
    return found


_SETS_TRACK_META: dict[type, bool] = {}


def _calls(fn: Callable[..., Any], name: str) -> bool:
    """Whether `fn`'s code calls a function named `name` (`name(...)` or `x.name(...)`; not a mention in a
    string). A function without source calls nothing found."""
    text = _source_text(fn)
    if name not in text:
        return False
    try:
        tree = ast.parse(textwrap.dedent(text))
    except SyntaxError:
        return False
    return any(
        isinstance(node, ast.Call) and name in (getattr(node.func, "id", None), getattr(node.func, "attr", None))
        for node in ast.walk(tree)
    )


# Code from these packages is named by module path; anything else (a class or function in the user's
# PIPELINE.py) by its name and source hash, because prep runs that file under a generated module name while
# training code imports it under its own.
_LIBRARIES = frozenset({"monai", "torch", "numpy", "scipy", "nibabel", "builtins", "loaders", "prep"})


def _qualname(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    module = str(getattr(cls, "__module__", ""))
    if module.split(".")[0] in _LIBRARIES:
        return f"{module}.{cls.__qualname__}"
    return f"{cls.__qualname__}@{_source_sha256(cls)}"


def _source_sha256(obj: Any) -> str:
    """Hash of the source of a function, or of a class's methods (a class from a file run by runpy has no
    module in sys.modules, so inspect cannot find the class itself, but finds its functions)."""
    if isinstance(obj, type):
        parts = [_source_text(v) for _, v in sorted(vars(obj).items()) if inspect.isfunction(v)]
        parts += [b.__qualname__ for b in obj.__mro__[1:]]
        text = "\n".join(parts)
    else:
        text = _source_text(obj)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _source_text(fn: Any) -> str:
    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return f"<no source: {getattr(fn, '__qualname__', type(fn).__name__)}>"


def _config(value: Any, depth: int = 0) -> Any:
    """A deterministic JSON-able rendering of a configuration value (no memory addresses, no RNG state)."""
    import numpy as np

    if depth > _MAX_DEPTH:
        return f"<{_qualname(value)}>"
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return repr(value)  # NaN/inf stay comparable, and repr round-trips exactly
    if isinstance(value, np.random.RandomState) or type(value).__name__ == "Generator":
        return "<rng>"
    if isinstance(value, type):
        return _qualname(value) if value.__module__ != "builtins" else value.__name__
    if isinstance(value, np.dtype):
        return value.str
    if isinstance(value, np.generic):
        return _config(value.item(), depth + 1)
    if isinstance(value, np.ndarray) or hasattr(value, "detach"):
        arr = to_numpy(value) if hasattr(value, "detach") else np.asarray(value)
        bits = dtype_name(arr.dtype) == "bfloat16"  # other dtypes keep the name fingerprints always had
        return {
            "array": "bfloat16" if bits else str(arr.dtype),
            "shape": list(arr.shape),
            "sha256": hashlib.sha256(arr.tobytes()).hexdigest(),
        }
    if isinstance(value, Mapping):
        return {str(k): _config(v, depth + 1) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_config(v, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((_config(v, depth + 1) for v in value), key=repr)
    if isinstance(value, functools.partial):  # its function and bound arguments live outside __dict__
        return {"partial": _config(value.func, depth + 1), "args": _config(value.args, depth + 1),
                "keywords": _config(value.keywords, depth + 1)}  # fmt: skip
    if inspect.isfunction(value) or inspect.ismethod(value) or inspect.isbuiltin(value):
        return _callable_config(value)
    if hasattr(value, "__dict__"):
        return {"class": _qualname(value), "config": _config(_attrs(value), depth + 1)}
    text = repr(value)  # objects without __dict__ (torch.float16, torch.device) are told apart by their repr
    return f"<{_qualname(value)}>" if " at 0x" in text else {"class": _qualname(value), "repr": text}


def _callable_config(fn: Callable[..., Any]) -> dict[str, Any]:
    """A function by name and, where available, a hash of its source (so an edited lambda changes the hash)."""
    module = str(getattr(fn, "__module__", ""))
    name = str(getattr(fn, "__qualname__", repr(type(fn))))
    if module.split(".")[0] in _LIBRARIES:
        return {"function": f"{module}.{name}"}
    return {"function": name, "source_sha256": _source_sha256(fn)}


def versions() -> dict[str, str]:
    """Versions of the libraries whose behaviour shapes the head's output."""
    import monai
    import numpy
    import torch

    from loaders._version import __version__

    return {
        "monai": monai.__version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "blockprep": __version__,
    }


# The version rule: a difference in these leading release numbers refuses the cache (the head's numerics may
# differ); any other difference (patch release, build tag such as +cpu/+cu130) is a VersionWarning.
REFUSE_ON = {"monai": 2, "torch": 2, "numpy": 1}


def _release(version: str, parts: int) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:parts])


def compare_versions(
    recorded: Mapping[str, str], current: Mapping[str, str] | None = None
) -> tuple[list[str], list[str]]:
    """(refusals, warnings) between the versions a cache was made with and these (REFUSE_ON is the rule)."""
    current = versions() if current is None else current
    refuse, warn = [], []
    for lib in sorted(set(recorded) | set(current)):
        old, new = str(recorded.get(lib, "?")), str(current.get(lib, "?"))
        if old == new:
            continue
        parts = REFUSE_ON.get(lib)
        text = f"{lib} {old} -> {new}"
        if parts is not None and (old == "?" or new == "?" or _release(old, parts) != _release(new, parts)):
            refuse.append(text)
        else:
            warn.append(text)
    return refuse, warn


_VERSIONS_FIX = "re-run `prep cache --force` with these libraries"
_HEAD_FIX = "re-run `prep cache` with this pipeline or pass the pipeline the cache was made with"


def check_versions(recorded: Mapping[str, str], where: str, fix: str = _VERSIONS_FIX) -> None:
    """StaleError when the libraries differ by REFUSE_ON from those the cache was made with (`fix`: what the
    message tells the user to do); else a VersionWarning for lesser differences (a patch release, another build
    of the same torch)."""
    refuse, warn = compare_versions(recorded)
    if refuse:
        raise StaleError(
            f"{where}: made with other library versions ({'; '.join(refuse)}), which may change the head's output; "
            f"{fix}"
        )
    if warn:
        warnings.warn(
            f"{where}: made under other library builds ({'; '.join(warn)}); accepted, as they keep the head's output",
            VersionWarning,
            stacklevel=2,
        )


# A MONAI Compose's options, with their defaults: how it applies its transforms.
COMPOSE_OPTIONS = {"map_items": True, "unpack_items": False, "log_stats": False, "lazy": False, "overrides": None}


def compose_options(transform: Any) -> dict[str, Any]:
    """The options of the user's Compose (map_items, unpack_items, log_stats, lazy, overrides); {} for a list."""
    return {n: getattr(transform, n) for n in COMPOSE_OPTIONS if hasattr(transform, n)}


def fingerprint(head: Iterable[Any], options: Mapping[str, Any] | None = None) -> str:
    """Stable sha256 of each transform's class and configuration (not its run-time state, not versions), and of
    the Compose's `lazy` and `overrides` where it resamples lazily (they change the head's output; left out
    otherwise, so caches made before keep their fingerprint)."""
    doc: dict[str, Any] = {"transforms": [{"class": _qualname(t), "config": _config(_attrs(t))} for t in head]}
    options = options or {}
    if options.get("lazy", False) is not False:
        doc["lazy"] = {"lazy": options["lazy"], "overrides": _config(options.get("overrides"))}
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _attrs(t: Any) -> Any:
    """The configuration of an object: its attributes less random state and state gained with use."""
    if inspect.isfunction(t) or inspect.ismethod(t):
        return _callable_config(t)
    if hasattr(t, "__dict__"):
        runtime = _runtime_attrs(type(t))  # type: ignore[arg-type]  # classes are hashable
        return {
            k: v
            for k, v in vars(t).items()
            if k not in _SKIP_ATTRS and k not in runtime and not isinstance(v, threading.local)
        }
    return None


# Methods that set configuration: constructors (and the helpers they call), property setters, set_* methods.
_CONSTRUCTORS = ("__init__", "__new__", "__post_init__")


# class -> its run-time attributes (`_runtime_attrs`), and those another process of this machine found, by
# "module:qualname" (`runtime_attrs_found`, `take_runtime_attrs`: local worker processes skip the source analysis)
_RUNTIME: dict[type, frozenset[str]] = {}
_GIVEN: dict[str, frozenset[str]] = {}


def runtime_attrs_found() -> dict[str, list[str]]:
    """What this process found of the classes it fingerprinted: {"module:qualname": run-time attributes}."""
    return {f"{c.__module__}:{c.__qualname__}": sorted(a) for c, a in list(_RUNTIME.items())}


def take_runtime_attrs(found: Mapping[str, Sequence[str]]) -> None:
    """Use another process's `runtime_attrs_found` for classes of the same names: for worker processes started
    on this machine from the same installation (their classes' sources are the same files). Source analysis
    is most of a fingerprint's CPU (docs/benchmarks.md, Preparation)."""
    _GIVEN.update({name: frozenset(attrs) for name, attrs in found.items()})


def _runtime_attrs(cls: type) -> frozenset[str]:
    """Attributes only assigned by methods that are not configuration methods (e.g. a reader's `filenames`,
    set by `read`): state an object gains with use. Found from the methods' source; an attribute a
    constructor also assigns stays configuration, so an unclear case changes the fingerprint, never hides."""
    found = _RUNTIME.get(cls)
    if found is None:
        found = _GIVEN.get(f"{cls.__module__}:{cls.__qualname__}")
        if found is None:
            found = _source_runtime_attrs(cls)
        _RUNTIME[cls] = found
    return found


def _source_runtime_attrs(cls: type) -> frozenset[str]:
    assigned: dict[str, set[str]] = {}
    calls: dict[str, set[str]] = {}
    config: set[str] = set()
    for klass in reversed(cls.__mro__):
        if klass.__module__ == "builtins":
            continue
        for name, member in vars(klass).items():
            if isinstance(member, property):
                if member.fset is not None:
                    key = f"{klass.__qualname__}.{name}.setter"
                    assigned[key], calls[key] = _self_assignments(member.fset)
                    config.add(key)
            elif inspect.isfunction(member):
                a, c = _self_assignments(member)
                assigned.setdefault(name, set()).update(a)
                calls.setdefault(name, set()).update(c)
                if name in _CONSTRUCTORS or name.startswith("set_"):
                    config.add(name)
    todo = [n for n in config if n in _CONSTRUCTORS]
    while todo:  # helpers a constructor calls (self._init_x()) are configuration too
        for callee in calls.get(todo.pop(), set()):
            if callee in assigned and callee not in config:
                config.add(callee)
                todo.append(callee)
    configured = set().union(*(assigned[n] for n in config)) if config else set()
    used = set().union(*(a for n, a in assigned.items() if n not in config)) if assigned else set()
    return frozenset(used - configured)


def _self_assignments(fn: Callable[..., Any]) -> tuple[set[str], set[str]]:
    """(attributes assigned on the first argument, methods called on it) in a function's source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return set(), set()
    func = tree.body[0] if tree.body else None
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or not func.args.args:
        return set(), set()
    me = func.args.args[0].arg
    assigned, called = set(), set()
    for node in ast.walk(func):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id == me
        ):
            called.add(node.func.attr)
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == me:
                    assigned.add(sub.attr)
    return assigned, called


def describe(transforms: Iterable[Any]) -> list[str]:
    """One short line per transform, e.g. "Spacingd(keys=('image', 'label'))", for manifests and messages."""
    lines = []
    for t in transforms:
        name = getattr(t, "__qualname__", None) if inspect.isfunction(t) else type(t).__name__
        keys = getattr(t, "keys", None)
        lines.append(f"{name}(keys={tuple(keys)!r})" if isinstance(keys, (list, tuple)) else f"{name}()")
    return lines


def check_fingerprint(
    transform: Any, manifest: Mapping[str, Any], where: str, fix: tuple[str, str] = (_HEAD_FIX, _VERSIONS_FIX)
) -> None:
    """StaleError unless the transform's head is the one the cache was prepared with (`manifest`: a manifest or
    a pending marker, `loaders.cache.pending`; `fix`: what to do about another head, about other versions)."""
    head, _ = split(transform)
    want = manifest.get("fingerprint")
    got = fingerprint(head, compose_options(transform))
    if want != got:
        cached = "; ".join(manifest.get("head", []) or []) or "unknown"
        ours = "; ".join(describe(head)) or "empty"
        raise StaleError(
            f"{where}: the cache was prepared with a different pipeline head (cache: {cached} | "
            f"this transform: {ours}; fingerprint {str(want)[:12]} != {got[:12]}); {fix[0]}"
        )
    # the fingerprint holds no versions: a cache made on a CPU node (torch +cpu) is read on a GPU node (+cu130)
    check_versions(manifest.get("versions", {}) or {}, where, fix[1])


def tail_compose(transform: Any) -> Any:
    """The random tail of `transform` as a MONAI Compose with the user's Compose options (None if empty);
    the user's transforms keep their random states."""
    from monai.transforms import Compose

    from loaders.state import keep_random_states

    with keep_random_states(transform):
        _, tail = split(transform)
        if not tail:
            return None
        return Compose(tail, **compose_options(transform))
