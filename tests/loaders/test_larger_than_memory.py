"""A prepared cache twice the memory its reader may use: one epoch of `PreparedLoader` (its defaults, on the CPU) and
one of `PreparedPersistentDataset` under a DataLoader, each in a child process inside a memory cgroup of half the
cache's size (swap off for it), deliver every item once, with MONAI's values, and nothing is killed for memory.
The cgroup is at least the child's imports plus room to read: torch 2.13's CPU build, MONAI and the loader import
at 290 MiB, torch 2.3.1's CUDA build at 449 MiB, and the cache grows with it."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from workflows.bench.memcg import MemoryCgroup, cgroup_reason
from workflows.bench.train_loop import pipeline_source

pytestmark = pytest.mark.slow

MiB = 1 << 20
LEAST = 384 * MiB  # the cgroup where the imports leave room (torch 2.13: 290 MiB of imports)
ROOM = 128 * MiB  # past the imports: the reads, the batches, the page cache charged to the cgroup
SIZE, CROP = 128, 32  # 16 MiB an item (image and label, float32)
ITEM = 2 * SIZE**3 * 4
REPO = Path(__file__).resolve().parents[2]
SEED = 9
KEPT = 2  # batches whose values are compared with MONAI's

# run inside the cgroup: one epoch, every item's position noted, the first KEPT batches' values saved
_CHILD = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import numpy as np
import torch
from prep.cache import load_datalist
from prep.pipeline import load_pipeline
mode, root, out, seed, kept = sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
transform = load_pipeline(root / "pipeline.py").transform
saved, items = {}, []
if mode == "loader":
    from loaders.fast.loader import PreparedLoader
    batches = PreparedLoader(root / "cache", transform, batch_size=2, device="cpu")
    batches.set_random_state(seed)
else:
    from monai.data import DataLoader
    from loaders import PreparedPersistentDataset
    data = [entry for _, entry in load_datalist(root / "nifti" / "dataset.json")]
    torch.manual_seed(seed)
    batches = DataLoader(PreparedPersistentDataset(data, transform, root / "cache"), batch_size=2, num_workers=2)
for k, batch in enumerate(batches):
    items += [int(i) for i in batch["_items"]] if mode == "loader" else [-1] * len(batch["image"])
    if k < kept:
        saved.update({f"{key}{k}": np.asarray(batch[key]) for key in ("image", "label")})
np.savez(out, items=np.array(items), **saved)
"""


def imports_bytes() -> int:
    """What the child's imports take: the peak resident size of a fresh interpreter importing torch, MONAI's
    transforms and the loader."""
    code = ("import resource, torch, monai.transforms, loaders.fast.loader; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.split()[-1]) * 1024  # KiB on Linux


@pytest.fixture(scope="module")
def limit() -> int:
    """The cgroup's bytes: LEAST, or the imports plus ROOM where they take more (a whole 32 MiB)."""
    return max(LEAST, math.ceil((imports_bytes() + ROOM) / (32 * MiB)) * 32 * MiB)


@pytest.fixture(scope="module")
def count(limit: int) -> int:
    """Items in the cache: twice the cgroup's bytes (50 at 384 MiB: 800 MiB)."""
    return math.ceil(2 * limit / ITEM)


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory, limit: int, count: int) -> Path:
    """A folder with the spheres pipeline (32^3 crops), its NIfTI datalist and its prepared cache of twice `limit`."""
    reason = cgroup_reason()
    if reason:
        pytest.skip(reason)
    from prep.cache import prepare_cache
    from prep.synth import nifti_dataset

    root = tmp_path_factory.mktemp("larger")
    (root / "pipeline.py").write_text(pipeline_source(CROP))
    datalist = nifti_dataset(root / "nifti", count=count, size=SIZE, seed=3)
    prepare_cache(datalist, root / "pipeline.py", root / "cache", workers=2)
    from loaders.fast.loader import dataset_bytes

    assert dataset_bytes(root / "cache") >= 2 * limit
    return root


def _epoch_in_cgroup(root: Path, limit: int, mode: str, out: Path) -> dict[str, Any]:
    """One epoch in a child inside a fresh cgroup of `limit` bytes, the cache evicted first: what it saved."""
    from workflows.bench.core import evict, files_under

    evict(files_under(root / "cache"), drop_caches=False)  # read inside the cgroup: its page cache charged there
    with MemoryCgroup(limit) as cgroup:
        args = [str(REPO), mode, str(root), str(out), str(SEED), str(KEPT)]
        done = cgroup.run([sys.executable, "-c", _CHILD, *args], 600)
        assert (done.returncode, cgroup.oom_kills()) == (0, 0), done.stderr[-3000:]
    with np.load(out) as saved:
        return dict(saved)


def _transform(root: Path) -> Any:
    from prep.pipeline import load_pipeline

    return load_pipeline(root / "pipeline.py").transform


def _assert_values(got: dict[str, Any], want: list[dict[str, np.ndarray]]) -> None:
    for k in range(KEPT):
        for key in ("image", "label"):
            np.testing.assert_allclose(got[f"{key}{k}"], np.stack([w[key] for w in want[2 * k : 2 * k + 2]]))


def test_prepared_loader_trains_an_epoch_of_twice_its_memory(big: Path, limit: int, count: int, tmp_path: Path) -> None:
    from loaders import PreparedDataset
    from loaders.cache.chain import tail_compose

    got = _epoch_in_cgroup(big, limit, "loader", tmp_path / "loader.npz")
    assert sorted(got["items"].tolist()) == list(range(count))  # every item once
    tail = tail_compose(_transform(big))  # MONAI's per-item tail over the cached heads, in the epoch's order
    tail.set_random_state(seed=SEED)
    ds = PreparedDataset(big / "cache")
    want = [tail(ds[int(i)]) for i in got["items"][: 2 * KEPT]]
    _assert_values(got, [{k: np.asarray(w[k]) for k in ("image", "label")} for w in want])


def test_the_drop_in_trains_an_epoch_of_twice_its_memory(big: Path, limit: int, count: int, tmp_path: Path) -> None:
    import torch
    from monai.data import DataLoader, Dataset

    from prep.cache import load_datalist

    got = _epoch_in_cgroup(big, limit, "drop-in", tmp_path / "dropin.npz")
    assert len(got["items"]) == count
    data = [entry for _, entry in load_datalist(big / "nifti" / "dataset.json")]
    torch.manual_seed(SEED)  # MONAI's whole chain on the NIfTI files, its workers seeded as the child's were
    want = []
    for k, batch in enumerate(DataLoader(Dataset(data, _transform(big)), batch_size=2, num_workers=2)):
        want += [{key: np.asarray(batch[key][j]) for key in ("image", "label")} for j in range(2)]
        if k + 1 == KEPT:
            break
    _assert_values(got, want)


def test_prepared_loader_trains_an_epoch_of_twice_its_memory_from_bricks(
    big: Path, limit: int, count: int, tmp_path: Path
) -> None:
    """The same epoch with the cache's bricks written: its first cold reads go to the blocks and to the cache in
    turn (the first batch from the blocks), the values still MONAI's, nothing killed for memory."""
    from loaders import PreparedDataset
    from loaders.cache.chain import tail_compose
    from prep.bricks import build_bricks, drop_bricks

    build_bricks(big / "cache")
    try:
        got = _epoch_in_cgroup(big, limit, "loader", tmp_path / "bricks.npz")
    finally:
        drop_bricks(big / "cache")
    assert sorted(got["items"].tolist()) == list(range(count))
    tail = tail_compose(_transform(big))
    tail.set_random_state(seed=SEED)
    ds = PreparedDataset(big / "cache")
    want = [tail(ds[int(i)]) for i in got["items"][: 2 * KEPT]]
    _assert_values(got, [{k: np.asarray(w[k]) for k in ("image", "label")} for w in want])
