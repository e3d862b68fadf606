"""Items read buffered on the host come as copy-on-write mappings of the page cache (`Reader.mapped`)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loaders.cache.writing import write_items
from loaders.errors import BackendError, ChecksumError

torch = pytest.importorskip("torch")
from loaders import PreparedDataset  # noqa: E402
from loaders.reading.reads import Reader  # noqa: E402


def _cache(root: Path, n: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(2)
    items = [{"image": rng.random((1, 64, 64, 64), dtype=np.float32),  # 1 MiB: not a small item
              "label": rng.integers(0, 3, (1, 64, 64, 64), dtype=np.uint8)} for _ in range(n)]  # fmt: skip
    write_items(root, items)
    return items


def test_item_tensors_are_mappings_with_the_stored_values_and_writes_stay_private(tmp_path: Path) -> None:
    root = tmp_path / "c"
    items = _cache(root)
    shards = {p: p.read_bytes() for p in (root / "shards").glob("*.bin")}
    ds = PreparedDataset(root, backend="posix", meta=False)
    assert ds.reader.mapped(ds._plan(0).read) is not None  # this is the mapped path
    for i, item in enumerate(items):
        got = ds.read(i, mapped=True)
        for key in ("image", "label"):
            assert np.array_equal(got[key].numpy(), item[key]), key
    first = ds.read(0, mapped=True)  # what a transform sees
    first["image"].add_(1.0)  # a tail writing in place: this process's own pages
    first["label"][:, :8] = 9
    again = ds[0]
    assert np.array_equal(again["image"].numpy(), items[0]["image"])
    assert np.array_equal(again["label"].numpy(), items[0]["label"])
    assert {p: p.read_bytes() for p in shards} == shards  # the files are untouched
    ds.close()


def test_a_short_shard_is_named_not_mapped(tmp_path: Path) -> None:
    root = tmp_path / "c"
    _cache(root)
    (shard,) = (root / "shards").glob("*.bin")
    ds = PreparedDataset(root, backend="posix", meta=False)  # opened whole: the open checks the extents
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - (3 << 20))  # the last item's image is past the end now
    assert ds.reader.mapped(ds._plan(2).read) is None
    with pytest.raises(BackendError, match="short read"):
        ds[2]
    ds.close()


def test_checksums_and_other_backends_read_as_before(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "c"
    items = _cache(root)
    (shard,) = (root / "shards").glob("*.bin")
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF  # in the first item's first tensor
    shard.write_bytes(bytes(data))
    checked = PreparedDataset(root, backend="posix", meta=False, verify=True)
    assert checked.reader.mapped(checked._plan(0).read) is None
    with pytest.raises(ChecksumError):
        checked[0]
    checked.close()
    calls: list[int] = []
    real = Reader.mapped
    monkeypatch.setattr(Reader, "mapped", lambda self, plan: calls.append(1) or real(self, plan))
    direct = PreparedDataset(root, backend="direct", meta=False)
    assert np.array_equal(direct.read(1, mapped=True)["image"].numpy(), items[1]["image"])
    assert calls and direct.reader.mapped(direct._plan(1).read) is None  # O_DIRECT: never the page cache
    direct.close()


def test_items_held_in_memory_hold_no_descriptors(tmp_path: Path) -> None:
    """Mappings hold no file descriptor (Python's mmap keeps a duplicate one each): a caller keeping 2,000 items'
    tensors (4,000 mappings) uses none, and every mapping goes once its tensors are gone."""
    import os

    root = tmp_path / "c"
    items = _cache(root, n=2)
    ds = PreparedDataset(root, backend="posix", meta=False)
    ds[0]  # the shard's descriptor opened once
    fds = len(os.listdir("/proc/self/fd"))
    maps = Path("/proc/self/maps").read_text().count(str(root))
    held = [ds.read(i % 2, mapped=True) for i in range(2000)]  # what transforms see
    assert len(os.listdir("/proc/self/fd")) <= fds + 8  # (other tests' descriptors may close meanwhile)
    assert Path("/proc/self/maps").read_text().count(str(root)) >= maps + 4000 - 64
    assert np.array_equal(held[-1]["image"].numpy(), items[1]["image"])
    del held
    import gc

    gc.collect()
    assert Path("/proc/self/maps").read_text().count(str(root)) <= maps + 2
    ds.close()


def test_asking_for_a_long_run_reads_all_of_it(tmp_path: Path) -> None:
    """One madvise(WILLNEED) reads at most the device's readahead window or largest request (8 MiB on the 2-core
    box) and drops the rest; `will_need` asks for a longer run piece by piece, so the whole run comes in."""
    import mmap
    import os
    import time

    from loaders.backends.base import PageCacheProbe
    from loaders.reading.files import ask_limit
    from loaders.reading.mappings import private_map, will_need

    probe = PageCacheProbe()
    if not probe.available:
        pytest.skip("cachestat(2) is not available here (Linux 6.5+): the test counts cached pages")
    path = tmp_path / "long.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        limit = ask_limit(fd)
        n = 4 * limit + 3 * mmap.PAGESIZE
        os.write(fd, np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8).tobytes())
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        st = probe.counts(fd, 0, n)
        if st is None or st.cache:
            pytest.skip(f"posix_fadvise(DONTNEED) left pages of {path} cached here: nothing to count")
        view = private_map(fd, 0, n)
        assert view is not None
        assert will_need(view.ctypes.data, [(0, n)]) == 5
        deadline = time.monotonic() + 10
        while not probe.resident(fd, 0, n) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert probe.resident(fd, 0, n), probe.counts(fd, 0, n)  # one call for it all: `limit` bytes only
    finally:
        os.close(fd)
