"""The one read path: Reader.plan / fetch / upload over a real cache, and the staging helpers."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loaders.cache.format import PreparedCache
from loaders.cache.spec import ALIGN
from loaders.cache.writing import write_items
from loaders.errors import BackendError, ChecksumError

torch = pytest.importorskip("torch")
from loaders.reading import reads  # noqa: E402
from loaders.reading.reads import Reader  # noqa: E402
from loaders.reading.staging import Slot, host_array, packed_view, stack, view  # noqa: E402

N = 5


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    rng = np.random.default_rng(3)
    items = [
        {
            "image": rng.random((1, 16, 16, 16), dtype=np.float32),
            "label": rng.integers(0, 4, (1, 16, 16, 16), dtype=np.uint8),
            "coord": np.arange(i + 2, dtype=np.int64),
        }
        for i in range(N)
    ]
    root = tmp_path_factory.mktemp("reads") / "c"
    write_items(root, items)
    return root, items


def _tensors(reader: Reader, got: Any) -> dict[Any, dict[str, np.ndarray]]:
    flat = reader.upload(got)
    out: dict[Any, dict[str, np.ndarray]] = {}
    for tag, key, at, dtype, shape in got.places:
        out.setdefault(tag, {})[key] = view(flat, at, dtype, shape).numpy()
    return out


@pytest.mark.parametrize("key_major", [True, False])
def test_whole_plans_lay_tensors_out_aligned_and_read_them_in_one_call(cache, key_major: bool) -> None:
    root, items = cache
    reader = Reader(PreparedCache(root), ["image", "label", "coord"], "posix", verify=True)
    plan = reader.plan([3, 1, 3], key_major=key_major, tags=[0, 1, 2])
    at = [o for _, _, o in plan.tensors]
    assert all(o % ALIGN == 0 for o in at) and at == sorted(at)
    order = [(t, e.key) for t, e, _ in plan.tensors]
    if key_major:
        assert order == [(t, k) for k in ("image", "label", "coord") for t in range(3)]
    else:
        assert order == [(t, k) for t in range(3) for k in ("image", "label", "coord")]
    calls: list[int] = []
    real = reader.backend.read_into
    reader.backend.read_into = lambda r, b: (calls.append(len(r)), real(r, b))[1]  # type: ignore[method-assign]
    got = _tensors(reader, reader.fetch(plan))
    assert calls == [9]
    for tag, item in enumerate([3, 1, 3]):
        for key in ("image", "label", "coord"):
            np.testing.assert_array_equal(got[tag][key], items[item][key])
    reader.close()


def test_an_item_alone_is_merged_when_small_and_cut_when_large(cache, monkeypatch: pytest.MonkeyPatch) -> None:
    root, _ = cache
    from loaders.backends import get_backend

    reader = Reader(PreparedCache(root), ["image", "label"], get_backend("posix", threads=8))
    small = reader.plan([2], alone=True)
    assert small.small and len(small.requests) < len(small.tensors)
    monkeypatch.setattr(reads, "INLINE_BYTES", 0)
    monkeypatch.setattr(reads, "SPLIT_BYTES", 4096)
    cut = reader.plan([2], alone=True)
    assert not cut.small and len(cut.requests) == 4 + 1  # 16 KiB image in four pieces, the label whole
    assert sum(r.nbytes for r in cut.requests) == sum(e.nbytes for _, e, _ in cut.tensors)
    reader.close()


def test_packed_regions_land_in_one_buffer_key_major(cache) -> None:
    root, items = cache
    reader = Reader(PreparedCache(root), ["image", "label", "coord"], "posix", pooled=False)
    windows = [((2, 3, 0), (8, 8, 16)), ((0, 0, 0), (8, 8, 16))]  # 4 KiB float32 crops: back to back
    plan = reader.plan([4, 0], windows, keys=["image", "label"], tags=["a", "b"], packed=True)
    got = reader.fetch(plan)
    assert [p[:2] for p in got.places] == [("a", "image"), ("b", "image"), ("a", "label"), ("b", "label")]
    tensors = _tensors(reader, got)
    for tag, item, (start, shape) in zip("ab", [4, 0], windows):
        region = (slice(None), *(slice(s, s + n) for s, n in zip(start, shape)))
        for key in ("image", "label"):
            np.testing.assert_array_equal(tensors[tag][key], items[item][key][region])
    image = packed_view(reader.upload(got), got.places[:2])
    assert image is not None and tuple(image.shape) == (2, 1, 8, 8, 16)
    reader.close()


def test_unpacked_regions_come_one_array_each(cache) -> None:
    root, items = cache
    reader = Reader(PreparedCache(root), ["image", "coord"], "posix")
    got = reader.fetch(reader.plan([1], [((1, 2, 3), (4, 4, 4))], key_major=False))
    by_key = {r.entry.key: t.numpy() for (_, r), t in zip(got.plan.regions, reader.region_tensors(got))}
    np.testing.assert_array_equal(by_key["image"], items[1]["image"][:, 1:5, 2:6, 3:7])
    np.testing.assert_array_equal(by_key["coord"], items[1]["coord"])  # fewer dims than the window: whole
    reader.close()


class _HostStager:
    """PinnedStager's interface over ordinary memory: the pinned-slot path without a GPU."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.bufs: dict[int, np.ndarray] = {}
        self.uploads: list[tuple[int, int]] = []

    def host(self, slot: int, nbytes: int) -> np.ndarray:
        buf = self.bufs.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = self.bufs[slot] = np.empty(nbytes + ALIGN, dtype=np.uint8)
        return buf[:nbytes]

    def upload(self, slot: int, nbytes: int) -> Any:
        self.uploads.append((slot, nbytes))
        return torch.from_numpy(self.bufs[slot][:nbytes].copy())


def test_reads_for_a_gpu_land_in_the_pinned_slot_and_go_up_from_it(cache) -> None:
    root, items = cache
    reader = Reader(PreparedCache(root), ["image", "label"], "posix", device="cuda:0")
    assert reader.staged  # a host backend feeding a GPU
    stager = _HostStager(3)
    got = reader.fetch(reader.plan([2, 0]), Slot(stager, 7))  # slot 7 of 3: slot 1
    assert got.slot is not None and got.buf.ctypes.data == stager.bufs[1].ctypes.data
    tensors = _tensors(reader, got)
    assert stager.uploads == [(1, got.nbytes)]
    for tag, item in ((2, 2), (0, 0)):
        np.testing.assert_array_equal(tensors[tag]["image"], items[item]["image"])
    reader.close()


def test_short_reads_name_item_and_key(tmp_path: Path, cache) -> None:
    root, _ = cache
    copy = tmp_path / "c"
    shutil.copytree(root, copy)
    reader = Reader(PreparedCache(copy), ["image", "label"], "posix")
    last = reader.entries(N - 1)[-1]
    with open(last.shard, "r+b") as f:
        f.truncate(last.offset + 10)
    with pytest.raises(BackendError, match=rf"short read for item {N - 1} key '{last.key}'"):
        reader.fetch(reader.plan([N - 1]))
    reader.close()


def test_verify_refuses_a_changed_byte(tmp_path: Path, cache) -> None:
    root, _ = cache
    copy = tmp_path / "c"
    shutil.copytree(root, copy)
    reader = Reader(PreparedCache(copy), ["image"], "posix", verify=True)
    entry = reader.entries(1)[0]
    with open(entry.shard, "r+b") as f:
        f.seek(entry.offset)
        byte = f.read(1)
        f.seek(entry.offset)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ChecksumError, match="item 1 key 'image'"):
        reader.fetch(reader.plan([1]))
    reader.close()


def test_staging_helpers() -> None:
    a, b = torch.ones(2, 3), torch.zeros(2, 3)
    assert tuple(stack([a, b]).shape) == (2, 2, 3)
    ragged = [torch.ones(2, 3), torch.ones(3, 2)]
    assert isinstance(stack(ragged), list)
    shapes: dict[str, Any] = {}
    padded = stack(ragged, pad=True, shapes=shapes, key="x")
    assert tuple(padded.shape) == (2, 3, 3) and shapes["x"].tolist() == [[2, 3], [3, 2]]
    assert host_array(np.arange(3)).tolist() == [0, 1, 2]
    assert host_array(torch.arange(3)).tolist() == [0, 1, 2]
