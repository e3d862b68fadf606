"""PreparedDataset over a real cache: items, batches, shards, workers, threads, regions and bad input."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loaders.backends import BLOCK_RANGE_BACKENDS, backend_names, get_backend
from loaders.cache.spec import MANIFEST
from loaders.cache.writing import write_items
from loaders.deps import has
from loaders.errors import BackendError, ChecksumError, IncompleteCacheError, PrepError, SchemaVersionError

torch = pytest.importorskip("torch")
from loaders import PreparedBatches, PreparedDataset  # noqa: E402

# block-range backends need a bmap and a device: their own tests (loop images) cover them
CPU_BACKENDS = [n for n in backend_names() if n not in ("kvikio", "xnvme", *BLOCK_RANGE_BACKENDS)]
N = 7


def _items() -> tuple[list[dict], list[dict]]:
    rng = np.random.default_rng(5)
    items, metas = [], []
    for i in range(N):
        items.append(
            {
                "image": rng.random((1, 16, 16, 16), dtype=np.float32),  # 16 KiB: zero-copy batches
                "label": rng.integers(0, 4, (1, 16, 16, 16), dtype=np.uint8),
                "extra": {"ints": np.arange(i + 3, dtype=np.int64), "flag": np.array(i % 2 == 0)},
                "crops": [rng.random((5, 7), dtype=np.float64), rng.integers(0, 9, (3,), dtype=np.uint16)],
            }
        )
        affine = np.diag([2.0, 2.0, 3.0, 1.0])
        affine[:3, 3] = i
        metas.append(
            {
                "source": {"image": f"img{i}.nii.gz"},
                "meta": {
                    "image": {"affine": affine, "filename_or_obj": f"img{i}.nii.gz", "pixdim": [1, 2, 2, 3]},
                    "label": {"affine": affine, "filename_or_obj": f"lab{i}.nii.gz"},
                },
            }
        )
    return items, metas


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    items, metas = _items()
    root = tmp_path_factory.mktemp("cache") / "c"
    write_items(root, items, metas)
    return root, items


@pytest.fixture(params=CPU_BACKENDS)
def backend_name(request: pytest.FixtureRequest) -> str:
    try:
        get_backend(request.param).close()
    except PrepError as exc:
        pytest.skip(f"{request.param} unavailable here: {exc}")
    return str(request.param)


def _same(got: object, want: object) -> None:
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want)
        for k in want:
            _same(got[k], want[k])
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want)
        for g, w in zip(got, want):
            _same(g, w)
    else:
        array = got.as_tensor().numpy() if hasattr(got, "as_tensor") else got.numpy()  # type: ignore[attr-defined]
        assert array.dtype == np.asarray(want).dtype
        np.testing.assert_array_equal(array, want)


def test_items_round_trip_with_meta(cache: tuple[Path, list[dict]], backend_name: str) -> None:
    from monai.data import MetaTensor

    root, items = cache
    ds = PreparedDataset(root, backend=backend_name)
    assert len(ds) == N and isinstance(ds, torch.utils.data.Dataset)
    for i in range(N):
        _same(ds[i], items[i])
    image = ds[3]["image"]
    assert isinstance(image, MetaTensor)
    assert image.meta["filename_or_obj"] == "img3.nii.gz"
    assert image.affine.dtype == torch.float64
    np.testing.assert_array_equal(image.affine.numpy()[:3, 3], [3, 3, 3])
    np.testing.assert_array_equal(image.pixdim, [2, 2, 3])
    ds.close()


def test_plain_tensors_without_monai(cache: tuple[Path, list[dict]], monkeypatch: pytest.MonkeyPatch) -> None:
    from loaders import deps as _deps

    root, items = cache
    off = PreparedDataset(root, backend="posix", meta=False)[0]["image"]
    assert type(off) is torch.Tensor
    _deps.has.cache_clear()
    monkeypatch.setitem(sys.modules, "monai", None)
    try:
        item = PreparedDataset(root, backend="posix")[1]
    finally:
        _deps.has.cache_clear()
    assert type(item["label"]) is torch.Tensor
    _same(item, items[1])


def test_cached_meta_is_fresh_per_item(cache: tuple[Path, list[dict]]) -> None:
    from loaders.cache.meta import restore_meta

    root, _ = cache
    ds = PreparedDataset(root, backend="posix")
    first = ds[3]["image"]
    want = restore_meta(first.as_tensor().clone(), ds._item_meta(3)["meta"]["image"])
    assert set(first.__dict__) == set(want.__dict__)  # the template path builds what MetaTensor() builds
    assert first.meta.keys() == want.meta.keys()
    # spatial_ndim: MONAI >= 1.5 only
    assert getattr(first, "spatial_ndim", None) == getattr(want, "spatial_ndim", None)
    torch.testing.assert_close(first.affine, want.affine)
    np.testing.assert_array_equal(first.pixdim, want.pixdim)
    # MONAI transforms mutate meta, affine and applied_operations in place: nothing may leak to the next item
    first.meta["filename_or_obj"] = "changed"
    first.affine.add_(1)
    first.applied_operations.append({"class": "X"})
    again = ds[3]["image"]
    assert again.meta["filename_or_obj"] == "img3.nii.gz" and again.applied_operations == []
    np.testing.assert_array_equal(again.affine.numpy()[:3, 3], [3, 3, 3])
    assert again.meta is not first.meta and again.affine.data_ptr() != first.affine.data_ptr()


def test_item_reads_split_into_pieces(cache: tuple[Path, list[dict]], monkeypatch: pytest.MonkeyPatch) -> None:
    from loaders.reading import reads

    root, items = cache
    monkeypatch.setattr(reads, "SPLIT_BYTES", 4096)  # 16 KiB image: four pieces
    monkeypatch.setattr(reads, "INLINE_BYTES", 0)  # the pooled path, not the small-item one
    ds = PreparedDataset(root, keys=["image", "label"], backend=get_backend("posix", threads=8), meta=False)
    plan = ds._plan(2).read
    assert len(plan.requests) == 4 + 1
    assert sum(r.nbytes for r in plan.requests) == sum(e.nbytes for e in plan.entries)
    for i in range(N):
        _same(ds[i], {k: items[i][k] for k in ("image", "label")})
    ds.close()


@pytest.mark.parametrize("name", ["posix", "direct"])
def test_small_warm_item_reads_on_calling_thread(
    cache: tuple[Path, list[dict]], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """A small warm item is read with one pread per merged run on the calling thread (the backend's pool is
    never started) and gives the same tensors as the pooled path."""
    import threading

    from loaders.backends.base import PageCacheProbe
    from loaders.reading import reads

    if name == "direct" and not PageCacheProbe().available:
        pytest.skip("no cachestat(2) here: direct cannot tell warm from cold")
    root, items = cache
    keys = ["image", "label"]
    for shard in (root / "shards").glob("*.bin"):
        shard.read_bytes()  # warm
    pooled = PreparedDataset(root, keys=keys, backend=get_backend(name, threads=8), meta=False)
    monkeypatch.setattr(reads, "INLINE_BYTES", 0)
    monkeypatch.setattr(reads.Reader, "mapped", lambda self, plan: None)  # posix: the pooled path, not mappings
    want = [{k: v.clone() for k, v in pooled[i].items()} for i in range(N)]
    assert pooled.backend._pool is not None  # the pooled path did use the pool
    pooled.close()
    monkeypatch.undo()
    ds = PreparedDataset(root, keys=keys, backend=get_backend(name, threads=8), meta=False, verify=True)
    calls: list[int] = []
    real = os.preadv

    def spy(fd: int, bufs: list, offset: int) -> int:
        calls.append(threading.get_ident())
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "preadv", spy)
    for i in range(N):
        calls.clear()
        got = ds[i]
        assert calls and set(calls) == {threading.get_ident()}, "read off the calling thread"
        assert len(calls) == len(ds._plan(ds.items[i]).read.requests) <= 2  # one pread per run (no short reads here)
        _same(got, want[i])
        _same(got, {k: items[i][k] for k in keys})
    assert ds.backend._pool is None
    ds.close()


def test_keys_subset_and_unknown_key(cache: tuple[Path, list[dict]]) -> None:
    root, items = cache
    item = PreparedDataset(root, keys=["label"], backend="posix")[2]
    assert set(item) == {"label"}
    with pytest.raises(KeyError, match="not in the cache"):
        PreparedDataset(root, keys=["nope"])


def test_transform_is_applied(cache: tuple[Path, list[dict]]) -> None:
    root, items = cache
    ds = PreparedDataset(root, backend="posix", transform=lambda d: {"sum": d["label"].sum()})
    assert int(ds[4]["sum"]) == int(items[4]["label"].sum())


def test_batches_are_zero_copy_views(cache: tuple[Path, list[dict]], backend_name: str) -> None:
    root, items = cache
    ds = PreparedDataset(root, backend=backend_name)
    seen = []
    for batch in ds.iter_batches(3, prefetch=2):
        idx = batch["_items"].tolist()
        seen += idx
        np.testing.assert_array_equal(batch["image"].numpy(), np.stack([items[i]["image"] for i in idx]))
        np.testing.assert_array_equal(batch["label"].numpy(), np.stack([items[i]["label"] for i in idx]))
        if len(idx) > 1:
            assert isinstance(batch["extra"]["ints"], list)  # ragged: a list, not a stack
        assert batch["crops"][0].shape == (len(idx), 5, 7)
        assert batch["_meta"][0]["image"]["filename_or_obj"] == f"img{idx[0]}.nii.gz"
        # one read buffer: image and label views share its storage
        assert batch["image"].untyped_storage().data_ptr() == batch["label"].untyped_storage().data_ptr()
    assert seen == list(range(N))
    shuffled = [i for b in ds.iter_batches(2, shuffle=True, seed=1, drop_last=True) for i in b["_items"].tolist()]
    assert len(shuffled) == 6 and len(set(shuffled)) == 6 and shuffled != sorted(shuffled)


def test_shard_covers_everything_evenly(cache: tuple[Path, list[dict]]) -> None:
    root, _ = cache
    ds = PreparedDataset(root, backend="posix")
    for contiguous in (False, True):
        parts = [ds.shard(r, 3, contiguous=contiguous) for r in range(3)]
        assert {len(p) for p in parts} == {3}
        assert set(np.concatenate([p.items for p in parts]).tolist()) == set(range(N))
    uneven = [len(ds.shard(r, 3, even=False)) for r in range(3)]
    assert sorted(uneven) == [2, 2, 3]
    part = ds.shard(1, 3)
    assert part.items.tolist() == [1, 4, 0]  # strided, padded by wrapping around
    np.testing.assert_array_equal(part[1]["label"].numpy(), ds[4]["label"].numpy())
    with pytest.raises(ValueError, match="rank 3"):
        ds.shard(3, 3)


@pytest.mark.parametrize("workers", [0, 2])
def test_torch_dataloader(cache: tuple[Path, list[dict]], workers: int) -> None:
    root, items = cache
    ds = PreparedDataset(root, backend="posix", keys=["image", "label"], meta=False)
    ds[0]  # the parent's backend has a running thread pool: forked workers must not inherit it
    next(ds.iter_batches(2))
    loader = torch.utils.data.DataLoader(ds, batch_size=2, num_workers=workers, timeout=60 if workers else 0)
    got = torch.cat([b["label"] for b in loader]).numpy()
    np.testing.assert_array_equal(got, np.stack([it["label"] for it in items]))


def test_small_tensors_own_their_storage(cache: tuple[Path, list[dict]]) -> None:
    """A deep copy of a small output copies that output, not the whole item's read buffer (MONAI deep-copies
    the keys a label-driven crop leaves alone once per sample)."""
    import copy

    root, items = cache
    item = PreparedDataset(root, backend="posix", meta=False)[2]
    ints = item["extra"]["ints"]
    assert ints.untyped_storage().nbytes() == ints.numel() * ints.element_size()
    assert copy.deepcopy(item)["extra"]["ints"].tolist() == items[2]["extra"]["ints"].tolist()


def test_batches_split_across_workers(cache: tuple[Path, list[dict]]) -> None:
    root, _ = cache
    ds = PreparedDataset(root, backend="posix", keys=["image"], meta=False)
    ds[1]
    batches = PreparedBatches(ds, 2)
    assert len(batches) == 4
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=2, timeout=60)
    seen = sorted(i for b in loader for i in b["_items"].tolist())
    assert seen == list(range(N))  # each item exactly once across the two workers


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_resume_where_a_stopped_run_left(cache: tuple[Path, list[dict]], workers: int) -> None:
    """PreparedBatches.state_dict after batch k; a new dataset resumed from it gives the rest of the epoch
    and the next epochs as a run that never stopped (DataLoader workers: the loop says how far it got)."""

    from loaders.errors import LoaderStateError

    root, _ = cache

    def batches() -> Any:
        ds = PreparedDataset(root, backend="posix", keys=["image"], meta=False)
        return PreparedBatches(ds, 2, shuffle=True, seed=4)

    def run(b: Any) -> list[list[int]]:
        loader = torch.utils.data.DataLoader(b, batch_size=None, num_workers=workers, timeout=60 if workers else 0)
        return [x["_items"].tolist() for x in loader]

    whole = batches()
    want = [run(whole)]
    whole.set_epoch(1)
    want.append(run(whole))
    stopped = batches()
    loader = torch.utils.data.DataLoader(stopped, batch_size=None, num_workers=workers, timeout=60 if workers else 0)
    for k, _ in enumerate(loader, start=1):
        if k == 3:
            break
    saved = json.loads(json.dumps(stopped.state_dict(None if workers == 0 else k)))
    assert (saved["epoch"], saved["batch"]) == (0, 3)
    resumed = batches()
    resumed.load_state_dict(saved)
    assert run(resumed) == want[0][3:]
    resumed.set_epoch(1)
    assert run(resumed) == want[1] != want[0]
    with pytest.raises(LoaderStateError, match="batch_size=2"):
        PreparedBatches(PreparedDataset(root, backend="posix", keys=["image"], meta=False), 3).load_state_dict(saved)


def test_monai_thread_dataloader(cache: tuple[Path, list[dict]]) -> None:
    from monai.data import ThreadDataLoader

    root, items = cache
    ds = PreparedDataset(root, backend="posix", keys=["image"])
    loader = ThreadDataLoader(ds, batch_size=4, num_workers=2, use_thread_workers=True)
    got = torch.cat([b["image"].as_tensor() for b in loader]).numpy()
    np.testing.assert_array_equal(got, np.stack([it["image"] for it in items]))


def test_read_buffers_are_reused_only_when_free(cache: tuple[Path, list[dict]]) -> None:
    root, items = cache
    ds = PreparedDataset(root, backend="posix", keys=["image", "label"], meta=False)
    held = [ds[i] for i in range(N)]  # every item alive: no buffer may be reused under them
    for _ in range(2):
        for batch in ds.iter_batches(3, prefetch=2):
            batch["image"].add_(0)
        ds[0]
    for i in range(N):
        np.testing.assert_array_equal(held[i]["image"].numpy(), items[i]["image"])
        np.testing.assert_array_equal(held[i]["label"].numpy(), items[i]["label"])
    first = ds[1]["image"].data_ptr()
    assert ds[1]["image"].data_ptr() == first  # dropped at once: its faulted-in buffer is used again
    kept = ds[2]["image"]
    assert ds[3]["image"].data_ptr() != kept.data_ptr()
    np.testing.assert_array_equal(kept.numpy(), items[2]["image"])


def test_pickles_without_pool(cache: tuple[Path, list[dict]]) -> None:
    root, items = cache
    ds = PreparedDataset(root, backend="posix")
    ds[0]  # builds the backend and its descriptors
    copy = pickle.loads(pickle.dumps(ds.shard(0, 2)))
    _same(copy[1], items[2])


def test_region_reads_and_roi(cache: tuple[Path, list[dict]]) -> None:
    root, items = cache
    ds = PreparedDataset(root, backend="posix", meta=False)
    patch = ds.read_region(2, "image", (0, 3, 4, 5), (1, 8, 7, 6))
    np.testing.assert_array_equal(patch.numpy(), items[2]["image"][:, 3:11, 4:11, 5:11])
    roi = PreparedDataset(root, keys=["image", "label"], backend="posix", roi=((2, 2, 2), (4, 5, 6)))
    item = roi[1]
    np.testing.assert_array_equal(item["label"].as_tensor().numpy(), items[1]["label"][:, 2:6, 2:7, 2:8])
    assert item["image"].shape == (1, 4, 5, 6)

    def random_patch(i: int, shapes: dict) -> tuple:
        rng = np.random.default_rng(i)
        start = [int(rng.integers(0, s - 8 + 1)) for s in shapes["image"][1:]]
        return start, (8, 8, 8)

    ds2 = PreparedDataset(root, keys=["image", "label"], backend="posix", roi=random_patch, meta=False)
    item = ds2[5]
    s = random_patch(5, {"image": (1, 16, 16, 16)})[0]
    want = items[5]["label"][:, s[0] : s[0] + 8, s[1] : s[1] + 8, s[2] : s[2] + 8]
    np.testing.assert_array_equal(item["label"].numpy(), want)


def _copy_cache(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_checksum_mismatch_names_item_key_and_shard(cache: tuple[Path, list[dict]], tmp_path: Path) -> None:
    root = _copy_cache(cache[0], tmp_path / "bad")
    ds = PreparedDataset(root, backend="posix", verify=True)
    entry = next(e for e in ds.cache.entries(3) if e.key == "label")
    with open(entry.shard, "r+b") as f:
        f.seek(entry.offset + 10)
        old = f.read(1)
        f.seek(entry.offset + 10)
        f.write(bytes([old[0] ^ 0xFF]))
    with pytest.raises(ChecksumError, match=r"shard-000000\.bin: item 3 key 'label'"):
        ds[3]
    with pytest.raises(ChecksumError, match="item 3"):
        next(iter(ds.iter_batches(4)))
    ds[2]  # other items still read
    PreparedDataset(root, backend="posix", verify=False)[3]  # unverified reads do not check


def test_truncated_shard_names_item(cache: tuple[Path, list[dict]], tmp_path: Path, backend_name: str) -> None:
    root = _copy_cache(cache[0], tmp_path / "short")
    ds = PreparedDataset(root, backend=backend_name)
    last = max(ds.cache.entries(N - 1), key=lambda e: e.offset)  # the last bytes of the shard
    with open(last.shard, "r+b") as f:
        f.truncate(last.offset + last.nbytes - 1)
    with pytest.raises(BackendError, match=rf"shard-000000\.bin: short read for item {N - 1} key '{last.key}'"):
        ds[N - 1]
    with pytest.raises(BackendError, match=rf"short read for item {N - 1}"):
        list(ds.iter_batches(4))
    ds[0]


def test_incomplete_and_future_caches(cache: tuple[Path, list[dict]], tmp_path: Path) -> None:
    root = _copy_cache(cache[0], tmp_path / "future")
    doc = json.loads((root / MANIFEST).read_text())
    doc["schema_version"] = "9.0"
    (root / MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(SchemaVersionError, match="schema version 9.0"):
        PreparedDataset(root)
    (root / MANIFEST).unlink()
    with pytest.raises(IncompleteCacheError, match="manifest.json: missing"):
        PreparedDataset(root)


def test_import_loaders_imports_no_torch() -> None:
    code = (
        "import sys, loaders, loaders.faces.dataset, loaders.reading.region, loaders.reading.staging\n"
        "import loaders.faces.monai, loaders.faces.dali\n"
        "bad = [m for m in ('torch', 'monai', 'nvidia.dali') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["posix", "direct", "auto", "auto-cold"])
def test_gpu_delivery(cache: tuple[Path, list[dict]], backend: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    root, items = cache
    ds = PreparedDataset(root, backend=backend.removesuffix("-cold"), device="cuda:0", verify=True)
    if backend.startswith("auto"):  # kvikio (GDS, or compat with cold reads staged), else direct + pinned
        b = ds.backend
        assert b.name == "kvikio" if has("kvikio") else b.name == "direct"
        assert b.name != "kvikio" or b.mode == "gds" or b.stage_cold
    if backend.endswith("-cold"):  # out of the page cache: the staged O_DIRECT path of kvikio
        for shard in root.glob("shards/*"):
            fd = os.open(shard, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
    item = ds[2]
    assert item["image"].device.type == "cuda"
    _same({"image": item["image"].cpu()}, {"image": items[2]["image"]})
    for batch in ds.iter_batches(3, prefetch=2):
        idx = batch["_items"].tolist()
        assert batch["label"].is_cuda
        np.testing.assert_array_equal(batch["label"].cpu().numpy(), np.stack([items[i]["label"] for i in idx]))


def test_roi_applies_to_batches(cache: tuple[Path, list[dict]]) -> None:
    root, items = cache
    start, shape = (2, 3, 4), (5, 6, 7)
    ds = PreparedDataset(root, keys=["image", "label"], backend="posix", roi=(start, shape), meta=False)
    sl = (slice(None), slice(2, 7), slice(3, 9), slice(4, 11))
    seen = []
    for batch in ds.iter_batches(3):
        idx = batch["_items"].tolist()
        seen += idx
        assert batch["image"].shape == (len(idx), 1, *shape)
        np.testing.assert_array_equal(batch["image"].numpy(), np.stack([items[i]["image"][sl] for i in idx]))
        np.testing.assert_array_equal(batch["label"].numpy(), np.stack([items[i]["label"][sl] for i in idx]))
    assert seen == list(range(N))

    def per_item(i: int, shapes: dict) -> tuple:
        return (i % 3, 0, 1), (4, 4, 4)

    batches = PreparedBatches(PreparedDataset(root, keys=["label"], backend="posix", roi=per_item, meta=False), 4)
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=2, timeout=60)
    for batch in loader:
        for b, i in enumerate(batch["_items"].tolist()):
            np.testing.assert_array_equal(batch["label"][b].numpy(), items[i]["label"][:, i % 3 : i % 3 + 4, 0:4, 1:5])


@pytest.fixture(scope="module")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    """Items of unequal shapes, as real scans (and the demo) give."""
    rng = np.random.default_rng(9)
    items = []
    for i in range(5):
        shape = (1, 10 + i, 12 - i, 9 + 2 * (i % 2))
        items.append(
            {"image": rng.random(shape, dtype=np.float32), "label": (rng.random(shape) > 0.5).astype(np.uint8)}
        )
    metas = [{"source": {"image": f"r{i}.nii.gz"}, "meta": {"image": {"affine": np.eye(4)}}} for i in range(5)]
    root = tmp_path_factory.mktemp("ragged") / "c"
    write_items(root, items, metas)
    return root, items


def test_unequal_shapes_batch_form(ragged: tuple[Path, list[dict]]) -> None:
    root, items = ragged
    ds = PreparedDataset(root, backend="posix", meta=False)
    for batch in ds.iter_batches(2):
        idx = batch["_items"].tolist()
        assert isinstance(batch["image"], list) and len(batch["image"]) == len(idx) or len(idx) == 1
    for batch in ds.iter_batches(3, pad=True):
        idx = batch["_items"].tolist()
        image, shapes = batch["image"], batch["_shapes"]["image"] if len(idx) > 1 else None
        assert isinstance(image, torch.Tensor) and image.shape[0] == len(idx)
        for b, i in enumerate(idx):
            want = items[i]["image"]
            assert shapes is None or tuple(shapes[b].tolist()) == want.shape
            region = image[(b, *(slice(0, n) for n in want.shape))]
            np.testing.assert_array_equal(region.numpy(), want)
            assert float(image[b].sum()) == pytest.approx(float(want.sum()), rel=1e-5)  # padding is zeros


@pytest.mark.parametrize("workers", [0, 2])
def test_map_style_loaders_over_unequal_shapes(ragged: tuple[Path, list[dict]], workers: int) -> None:
    from monai.data import ThreadDataLoader

    from loaders import collate, pad_collate

    root, items = ragged
    ds = PreparedDataset(root, backend="posix")
    ds[0]
    plain = torch.utils.data.DataLoader(
        ds, batch_size=2, num_workers=workers, collate_fn=collate, timeout=60 * bool(workers)
    )
    got = [t for b in plain for t in b["label"]]
    assert [tuple(t.shape) for t in got] == [it["label"].shape for it in items]
    for t, it in zip(got, items):
        np.testing.assert_array_equal(np.asarray(t), it["label"])
    padded = ThreadDataLoader(ds, batch_size=3, num_workers=workers, collate_fn=pad_collate)
    batches = list(padded)
    assert [b["image"].shape[0] for b in batches] == [3, 2]
    first = batches[0]
    assert first["_shapes"]["image"].tolist() == [list(items[i]["image"].shape) for i in range(3)]
    np.testing.assert_array_equal(np.asarray(first["image"][1, :, :11, :11, :11]), items[1]["image"])


def test_auto_reads_buffered_when_the_cache_fits_in_memory(
    cache: tuple[Path, list[dict]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """O_DIRECT never fills the page cache: a cache that fits is read buffered so epoch 2 is a copy."""
    from loaders.reading import reads

    root, items = cache
    assert reads.fits_in_memory(1 << 20) and not reads.fits_in_memory(1 << 60)
    assert PreparedDataset(root).backend.name == "posix"
    monkeypatch.setattr(reads, "fits_in_memory", lambda nbytes, share=0.5: False)
    ds = PreparedDataset(root)
    assert ds.backend.name == "direct"
    _same(ds[3]["label"], items[3]["label"])


def _ddp_rank(rank: int, world: int, init: str, root: str, out: str) -> None:
    """One DDP rank (spawned): its shards' items and what it read, every epoch, gathered on rank 0."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    ds = PreparedDataset(root, keys=["label"], backend="posix", meta=False)
    seen: dict = {}
    for even in (False, True):
        part = ds.shard(rank, world, shuffle=True, seed=3, even=even)
        for epoch in range(3):
            part.set_epoch(epoch)
            sums = [int(part[j]["label"].sum()) for j in range(len(part))]  # what the rank actually read
            gathered: list = [None] * world
            dist.all_gather_object(gathered, (part.items.tolist(), sums))
            seen.setdefault(str(even), []).append(gathered)
    if rank == 0:
        Path(out).write_text(json.dumps(seen))
    dist.barrier()  # both ranks done before either leaves (torch 2.3's gloo hung a lone rank)
    # No teardown: under torch 2.3 destroying the gloo group joined its worker thread while holding the GIL, and
    # that thread was freeing an all_gather's tensors, which needs the GIL (a deadlock, seen in CI 2026-11-26).
    # This rank's work is written and both ranks passed the barrier: leave with the status mp.spawn expects.
    os._exit(0)


def test_shard_set_epoch_over_gloo(cache: tuple[Path, list[dict]], tmp_path: Path) -> None:
    """Two real gloo ranks: every item once per epoch across ranks, another split every epoch."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    root, items = cache
    out = tmp_path / "seen.json"
    mp.spawn(_ddp_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(root), str(out)), nprocs=2, join=True)
    seen = json.loads(out.read_text())
    label_sum = {i: int(items[i]["label"].sum()) for i in range(N)}
    for even in (False, True):
        splits = []
        for (a, sums_a), (b, sums_b) in seen[str(even)]:
            assert [label_sum[i] for i in a] == sums_a and [label_sum[i] for i in b] == sums_b
            if even:
                assert len(a) == len(b) == 4 and set(a) | set(b) == set(range(N))  # one item padded in
            else:
                assert sorted(a + b) == list(range(N))  # exactly once
            splits.append(tuple(sorted(a)))
        assert len(set(splits)) > 1  # the split changes between epochs
