"""What `prep cache` tests share: the repository's paths, a pipeline whose head is slow on purpose, and a prepared
cache compared with a clean `prep cache` run, tensor for tensor."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from loaders.cache.format import PreparedCache
from prep.cache import prepare_cache
from prep.cache_verify import verify_cache
from prep.cli import app

REPO = Path(__file__).resolve().parents[1]
SPHERES = REPO / "workflows" / "pipelines" / "spheres.py"


def slow_pipeline(seconds: float) -> str:
    """A PIPELINE.py whose head sleeps `seconds` an item (a run long enough to kill mid-way), then a random flip."""
    return f"""
import time
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, MapTransform, RandFlipd

class Slow(MapTransform):
    def __call__(self, d):
        time.sleep({seconds})
        return d

transform = Compose([LoadImaged(keys=["image", "label"]), EnsureChannelFirstd(keys=["image", "label"]),
                     Slow(keys=["image"]), RandFlipd(keys=["image"], prob=0.5)])
"""


def contents(root: Path) -> list[tuple[dict[str, Any], dict[str, tuple[str, tuple[int, ...], bytes]]]]:
    """Every item's meta line and tensors (dtype, shape, bytes), in the cache's order."""
    cache = PreparedCache(root)
    out = []
    for n in range(len(cache)):
        tensors = {}
        for e in cache.entries(n):
            with open(e.shard, "rb") as f:
                f.seek(e.offset)
                tensors[e.key] = (str(e.dtype), tuple(e.shape), f.read(e.nbytes))
        out.append((cache.meta(n), tensors))
    return out


def same_as_clean(tmp_path: Path, datalist: Path, pipeline: Path, out: Path) -> None:
    """`out` holds what a clean --force run on `datalist` makes, item by item, and passes `prep verify`."""
    clean = tmp_path / "clean"
    prepare_cache(datalist, pipeline, clean, workers=1, processes=False, force=True)
    got, want = contents(out), contents(clean)
    assert len(got) == len(want)
    for n, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"item {n} differs from the clean run's"
    keep = ("keys", "n_items", "datalist_hash", "fingerprint", "quarantined", "tensor_bytes")
    mine, theirs = PreparedCache(out).manifest, PreparedCache(clean).manifest
    assert {k: mine[k] for k in keep} == {k: theirs[k] for k in keep}
    assert verify_cache(out) == []
    result = CliRunner().invoke(app, ["verify", str(out)])
    assert result.exit_code == 0, result.output
