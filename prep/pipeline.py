"""The user's MONAI transform chain: load it, split it into deterministic head / random tail, fingerprint it.

Two forms are accepted:
  * PIPELINE.py exposing a `Compose` (or list) of dictionary transforms named `transform`;
  * a MONAI bundle config (.json/.yaml/.yml) whose chain is named by `bundle_key` (e.g. "preprocessing"
    or "train#preprocessing"), parsed with `monai.bundle.ConfigParser`.

The split and fingerprint themselves live in `loaders.cache.chain`, so training-time loaders agree with them.
"""

from __future__ import annotations

import hashlib
import runpy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loaders.cache import chain
from prep.errors import UsageError

BUNDLE_SUFFIXES = (".json", ".yaml", ".yml")
DEFAULT_BUNDLE_KEY = "preprocessing"


@dataclass
class Pipeline:
    """A loaded transform chain with its head, tail and the head's fingerprint."""

    path: Path
    bundle_key: str | None
    transform: Any
    head: list[Any]
    tail: list[Any]
    fingerprint: str = ""
    head_description: list[str] = field(default_factory=list)
    tail_description: list[str] = field(default_factory=list)
    head_reason: str = ""  # where the head ends and why (chain.head_end), for summaries and the manifest

    def head_compose(self) -> Any:
        """The head as a MONAI Compose with the user's Compose settings (lazy, map_items, overrides)."""
        from monai.transforms import Compose

        return Compose(self.head, **chain.compose_options(self.transform))


def load_pipeline(path: str | Path, bundle_key: str | None = None) -> Pipeline:
    """Load PIPELINE.py (its `transform`) or a bundle config (its `bundle_key` entry); check it and split it."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: pipeline file not found; pass a PIPELINE.py or a MONAI bundle config")
    if path.suffix in BUNDLE_SUFFIXES:
        transform = _load_bundle(path, bundle_key or DEFAULT_BUNDLE_KEY)
        key: str | None = bundle_key or DEFAULT_BUNDLE_KEY
    elif path.suffix == ".py":
        if bundle_key:
            raise UsageError(f"{path}: --bundle-key applies to bundle configs (.json/.yaml), not to a .py file")
        transform = _load_python(path)
        key = None
    else:
        raise UsageError(f"{path}: unknown pipeline kind; use a .py file or a bundle config (.json/.yaml)")
    transform = _as_compose(path, transform)
    _check_dictionary(path, transform)
    head, tail = chain.split(transform)
    return Pipeline(
        path=path.resolve(),
        bundle_key=key,
        transform=transform,
        head=head,
        tail=tail,
        fingerprint=chain.fingerprint(head, chain.compose_options(transform)),
        head_description=chain.describe(head),
        tail_description=chain.describe(tail),
        head_reason=chain.split_reason(transform),
    )


def _load_python(path: Path) -> Any:
    try:
        namespace = runpy.run_path(str(path), run_name=f"blockprep_pipeline_{_digest(path)}")
    except Exception as exc:  # the user's file: any error is theirs to fix, reported in one line
        raise UsageError(f"{path}: failed to run ({type(exc).__name__}: {exc}); fix the pipeline file") from exc
    if "transform" not in namespace:
        raise UsageError(f"{path}: defines no `transform`; add `transform = Compose([...])` with your chain")
    return namespace["transform"]


def _load_bundle(path: Path, key: str) -> Any:
    from monai.bundle import ConfigParser

    parser = ConfigParser()
    try:
        parser.read_config(str(path))
    except Exception as exc:  # yaml/json syntax errors of many kinds
        raise UsageError(f"{path}: not a readable bundle config ({type(exc).__name__}: {exc})") from exc
    if key not in parser:
        top = ", ".join(sorted(str(k) for k in parser.get())) if isinstance(parser.get(), dict) else ""
        raise UsageError(f"{path}: no entry '{key}' (top-level: {top}); name the chain with --bundle-key")
    try:
        return parser.get_parsed_content(key, instantiate=True)
    except Exception as exc:
        raise UsageError(f"{path}: cannot build '{key}' ({type(exc).__name__}: {exc})") from exc


def _as_compose(path: Path, transform: Any) -> Any:
    from monai.transforms import Compose

    if isinstance(transform, Compose):
        return transform
    if isinstance(transform, (list, tuple)) and all(callable(t) for t in transform):
        return Compose(list(transform))
    raise UsageError(f"{path}: `transform` is a {type(transform).__name__}, not a monai Compose or list of transforms")


def _check_dictionary(path: Path, transform: Any) -> None:
    """Refuse array transforms: the cache stores dictionaries of named tensors. MONAI's own forms over a
    whole dict are accepted: OneOf/SomeOf/RandomOrder of dictionary transforms (MONAI has no OneOfd; their
    members are checked) and Lambda/RandLambda (the function gets the whole dict)."""
    from monai.transforms import Compose, Lambda, MapTransform, RandLambda, Transform

    def check(transforms: list[Any], where: str) -> None:
        for i, t in enumerate(transforms):
            if isinstance(t, Compose):
                check(list(t.transforms), f"{where}{i} ({type(t).__name__}) > ")
            elif isinstance(t, Transform) and not isinstance(t, (MapTransform, Lambda, RandLambda)):
                name = type(t).__name__
                raise UsageError(
                    f"{path}: transform {where}{i} ({name}) is an array transform; use dictionary transforms ({name}d)"
                )

    check(chain._flat_transforms(transform), "")


def _digest(path: Path) -> str:
    return hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]


def file_sha256(path: str | Path) -> str:
    """sha256 of a pipeline file's bytes, as the manifest records it (`pipeline_sha256`)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
