"""Argument checks of the readers (`PreparedLoader`, `PreparedDataset`, `PreparedPersistentDataset`, the DALI
sources), run when the object is built: each bad value is one line of an `ArgumentError` subclass that is
also the TypeError, ValueError, KeyError or IndexError Python code expects. Strings never mean yes."""

from __future__ import annotations

import math
import numbers
import os
import re
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from loaders.errors import (
    ArgumentIndexError,
    ArgumentKeyError,
    ArgumentPathError,
    ArgumentTypeError,
    ArgumentValueError,
)
from loaders.tunables import MAX_WORLD_SIZE

MAX_SEED = 2**63 - 1
_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}  # fmt: skip


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def count(name: str, value: Any, low: int = 1) -> int:
    """A whole number >= low (bools, floats and strings refused)."""
    if not _is_int(value):
        raise ArgumentTypeError(f"{name}={value!r} is not a whole number; pass an int >= {low}")
    if value < low:
        raise ArgumentValueError(f"{name}={value!r} must be at least {low}")
    return int(value)


def flag(name: str, value: Any, also: tuple[str, ...] = ()) -> Any:
    """True or False (or one of the named strings, e.g. 'auto'): 'no' and 'yes' are refused, not truthy."""
    if isinstance(value, (bool, np.bool_)) or (isinstance(value, str) and value in also):
        return value
    allowed = " or ".join(["True", "False", *(repr(a) for a in also)])
    raise ArgumentTypeError(f"{name}={value!r} is not a flag; pass {allowed}")


def seed(value: Any, name: str = "seed") -> int:
    """A seed in 0..2**63-1 (what torch and numpy both take)."""
    if not _is_int(value):
        raise ArgumentTypeError(f"{name}={value!r} is not an integer seed; pass an int in 0..2**63-1")
    if not 0 <= value <= MAX_SEED:
        raise ArgumentValueError(f"{name}={value} is outside 0..2**63-1")
    return int(value)


def parse_bytes(value: int | str | None, name: str = "") -> int:
    """Bytes from an int or a string such as "8GiB", "500MB", "1.5g" (k/M/G/T: powers of 1000, Ki/Mi/Gi/Ti:
    of 1024; None -> 0). `name` (e.g. "--max-item-bytes") leads the message of a refusal."""
    said = f"{name} {value!r}" if name else repr(value)
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, (int, np.integer, str)):
        raise ArgumentValueError(f"{said} is not a size; use bytes or e.g. '8GiB', '500MB'")
    if isinstance(value, (int, np.integer)):
        if value < 0:
            raise ArgumentValueError(f"{said} is not a size: sizes are >= 0 bytes")
        return int(value)
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]*)?)\s*([kmgt]i?)?b?\s*", str(value).lower())
    if m is None:
        raise ArgumentValueError(f"{said} is not a size; use bytes or e.g. '8GiB', '500MB'")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def cache_dir(value: Any) -> None:
    """A path (str or os.PathLike)."""
    if not isinstance(value, (str, os.PathLike)):
        raise ArgumentTypeError(f"cache_dir={value!r} is not a path; pass the folder `prep cache --output` wrote")


def path(name: str, value: Any, allow_none: bool = False) -> None:
    """A path (str or os.PathLike), or None where allowed."""
    if value is None and allow_none:
        return
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ArgumentTypeError(f"{name}={_short(value)} is not a path; pass a str or pathlib.Path")


def folder(name: str, value: Any) -> None:
    """A path naming a folder that exists."""
    path(name, value)
    if not os.path.isdir(value):
        raise ArgumentPathError(f"{name}={os.fspath(value)!r}: no such folder")


def patterns(name: str, value: Any) -> None:
    """A list of glob patterns (a single string would be read as one pattern per character)."""
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise ArgumentTypeError(f"{name}={_short(value)} is not a list of patterns; pass e.g. ['*.jpg', '*.png']")


def options(name: str, value: Any) -> None:
    """None or a mapping of keyword arguments."""
    if value is not None and not isinstance(value, Mapping):
        raise ArgumentTypeError(f"{name}={_short(value)} is not a dict of keyword arguments")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def device(value: Any, allow_none: bool = False) -> None:
    """'cpu', 'cuda' or 'cuda:N' (a torch.device too); a CUDA device only where torch sees a GPU."""
    if value is None and allow_none:
        return
    if type(value).__name__ == "device":  # torch.device, without importing torch here
        value = str(value)
    if not isinstance(value, str):
        raise ArgumentTypeError(f"device={value!r} is not a device name; pass 'cpu' or 'cuda:N'")
    kind, _, index = value.partition(":")
    if kind not in ("cpu", "cuda") or (index and not (kind == "cuda" and index.isdigit())):
        raise ArgumentValueError(f"device={value!r} is not 'cpu', 'cuda' or 'cuda:N'")
    if kind == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ArgumentValueError(f"device={value!r} but this torch sees no CUDA GPU; pass device='cpu'")


def keys(value: Any, known: Sequence[str], where: Any) -> list[str] | None:
    """None (all keys) or a list of the cache's keys; the message lists them."""
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, Sequence) or not all(isinstance(k, str) for k in value):
        raise ArgumentTypeError(f"keys={value!r} is not a list of key names; the cache has {list(known)}")
    missing = [k for k in value if k not in known]
    if missing:
        raise ArgumentKeyError(f"{where}: keys {missing} are not in the cache (it has {list(known)})")
    return list(value)


def index(value: Any, n: int) -> int:
    """An item index in -n..n-1."""
    if not _is_int(value):
        raise ArgumentTypeError(f"index {value!r} is not an integer item index")
    if not -n <= value < n:
        raise ArgumentIndexError(f"index {value} is outside a dataset of {n} items")
    return int(value)


def indices(value: Any, n: int) -> np.ndarray:
    """Integer positions in -n..n-1, as an int64 array."""
    array = np.asarray(value)
    if array.size and array.dtype.kind not in "iu":
        raise ArgumentTypeError(f"subset indices of dtype {array.dtype} are not integer positions")
    if array.ndim != 1:
        raise ArgumentValueError(f"subset indices must be a flat list of positions, not {array.ndim}-D")
    if array.size and (int(array.min()) < -n or int(array.max()) >= n):
        raise ArgumentIndexError(f"subset indices reach outside a dataset of {n} items")
    return array.astype(np.int64)


def shard(rank: Any, world_size: Any, names: tuple[str, str] = ("rank", "world_size")) -> None:
    """DDP rank and world size (a DALI source's shard_id and num_shards): whole numbers, world_size >= 1,
    0 <= rank < world_size."""
    count(names[1], world_size, 1)
    count(names[0], rank, 0)
    if world_size > MAX_WORLD_SIZE:
        raise ArgumentValueError(f"{names[1]} {world_size} is over the {MAX_WORLD_SIZE} ranks a reader is sharded "
                                 "over; pass the number of processes of the run")  # fmt: skip
    if rank >= world_size:
        raise ArgumentValueError(f"{names[0]} {rank} is outside {names[1].replace('_', ' ')} {world_size}")


def interval(name: str, value: Any) -> None:
    """None or a positive, finite number of seconds."""
    if value is None:
        return
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise ArgumentTypeError(f"{name}={value!r} is not a number of seconds")
    if not (math.isfinite(float(value)) and float(value) > 0):
        raise ArgumentValueError(f"{name}={value!r} must be a positive, finite number of seconds")


def check_loader(args: Mapping[str, Any]) -> None:
    """Every argument of `PreparedLoader.__init__` (its locals(), the cache open as self.cache)."""
    cache = args["self"].cache
    count("batch_size", args["batch_size"])
    seed(args["seed"])
    device(args["device"], allow_none=True)
    for name in ("shuffle", "drop_last", "verify"):
        flag(name, args[name])
    flag("feeder", args["feeder"], also=("auto",))
    if args["tail_thread"] is not None:
        flag("tail_thread", args["tail_thread"])
    flag("crop_read", args["crop_read"], also=("auto",))
    count("prefetch", args["prefetch"], 0)
    interval("switch_interval", args["switch_interval"])
    keys(args["keys"], cache.keys, cache.root)
    if args["copy_threads"] is not None:
        count("copy_threads", args["copy_threads"])
    if args["torch_threads"] is not None:
        count("torch_threads", args["torch_threads"])
    count("workers", args["workers"], 0)
    if args["drop_last"] and args["batch_size"] > len(cache):
        warnings.warn(
            f"PreparedLoader: batch_size={args['batch_size']} is larger than the {len(cache)} items of "
            f"{cache.root} and drop_last=True: every epoch is empty; lower batch_size or pass drop_last=False",
            UserWarning,
            stacklevel=3,
        )


def check_dataset(cache: Any, keys_: Any, backend_: Any, device_: Any, verify: Any, meta: Any) -> list[str] | None:
    """The arguments of `PreparedDataset` (and `PreparedPersistentDataset`) that the cache can judge (the
    backend is checked first, by `loaders.backends.check_backend`)."""
    device(device_)
    flag("verify", verify)
    flag("meta", meta)
    return keys(keys_, cache.keys, cache.root)


def check_batches(
    batch_size: Any, prefetch: Any, shuffle: Any, seed_: Any, drop_last: Any, pad: Any, epoch: Any
) -> None:
    """The arguments of `iter_batches` / `PreparedBatches`."""
    count("batch_size", batch_size)
    count("prefetch", prefetch, 0)
    count("epoch", epoch, 0)
    seed(seed_)
    for name, value in (("shuffle", shuffle), ("drop_last", drop_last), ("pad", pad)):
        flag(name, value)


def check_epoch_source(batch_size: Any, shuffle: Any, seed_: Any, shard_id: Any, num_shards: Any) -> None:
    """The arguments every DALI source (`loaders.faces.dali`) shares."""
    count("batch_size", batch_size)
    flag("shuffle", shuffle)
    seed(seed_)
    shard(shard_id, num_shards, ("shard_id", "num_shards"))


def transform(value: Any) -> None:
    """The drop-in's transform: the pipeline the cache was prepared with (a Compose, a transform, or a list
    of them), never None or a path to it."""
    if value is None:
        raise ArgumentTypeError(
            "transform=None: the drop-in needs the pipeline the cache was prepared with (`prep cache` ran its "
            "head; its tail runs here); pass that Compose"
        )
    if isinstance(value, (str, os.PathLike)):
        raise ArgumentTypeError(
            f"transform={os.fspath(value)!r} is a path, not a transform; pass the Compose it defines "
            "(e.g. prep.pipeline.load_pipeline(path).transform)"
        )
    steps = value if isinstance(value, (list, tuple)) else [value]
    bad = [t for t in steps if not callable(t)]
    if bad:
        raise ArgumentTypeError(f"transform {_short(bad[0])} is not a transform; pass the pipeline's Compose")


def check_dropin(data: Any, transform_: Any, cache_dir_: Any, track_meta: Any, extra: Sequence[str]) -> None:
    """The arguments of `PreparedPersistentDataset` checked before anything is built; `extra`: options
    that neither PersistentDataset nor PreparedDataset takes."""
    if isinstance(data, (str, bytes, Mapping)) or not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
        raise ArgumentTypeError(
            f"data={_short(data)} is not a list of datalist entries; pass the list PersistentDataset takes "
            "(e.g. monai.data.load_decathlon_datalist(...))"
        )
    if transform_ is not None:  # None: PersistentDataset's (no transform), as cache_dir=None is (no cache)
        transform(transform_)
    if cache_dir_ is not None:
        cache_dir(cache_dir_)
    if track_meta is not None:
        flag("track_meta", track_meta)
    if extra:
        raise ArgumentTypeError(
            f"PreparedPersistentDataset: unknown option(s) {sorted(extra)}; it takes PersistentDataset's "
            "arguments and PreparedDataset's (backend, device, verify, keys, roi, backend_options)"
        )
