"""DALI sources in real DALI CPU pipelines: same (file, label) pairs as fn.readers.file, cache tensors, bmaps."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fsutil import evict_tree, interleaved_appends

import loaders.faces.dali_base
from loaders.cache.writing import write_items
from loaders.faces.dali import BmapSource, CacheSource, FileSource, list_labeled_files
from loaders.reading.files import cached_whole

dali = pytest.importorskip("nvidia.dali")
fn = pytest.importorskip("nvidia.dali.fn")
pipeline_def = dali.pipeline_def


def _readers_file(root: Path) -> list[tuple[str, int]]:
    """(relative path, label) in the order a real DALI readers.file pipeline yields them."""

    @pipeline_def(batch_size=4, num_threads=1, device_id=None)
    def pipe() -> Any:
        data, label = fn.readers.file(file_root=str(root), name="r")
        return data, label

    p = pipe()
    p.build()
    n = p.epoch_size("r")
    out: list[tuple[str, int]] = []
    while len(out) < n:
        data, labels = p.run()
        out += [(data[i].source_info(), int(np.array(labels[i]).item())) for i in range(len(data))]
    return out[:n]


def _tricky_tree(root: Path) -> Path:
    """Byte-order folder names, an empty class, upper-case and hidden images, non-images, nested files."""
    for rel in ["b/2.jpg", "b/10.jpg", "b/x.JPG", "b/notes.txt", "a/1.png", "a/sub/deep.jpg", "a/.hidden.jpg",
                "C/q.jpeg", "C/r.webp", "Ab/k.bmp", "top.jpg"]:  # fmt: skip
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rel.encode() * 3)
    (root / "B0").mkdir()
    return root


def test_labels_match_dali_readers_file(image_tree: Path, tmp_path: Path) -> None:
    assert list_labeled_files(image_tree) == _readers_file(image_tree)
    tricky = _tricky_tree(tmp_path / "tricky")
    assert list_labeled_files(tricky) == _readers_file(tricky)
    assert FileSource(tricky, backend="posix").files == _readers_file(tricky)


@pytest.mark.parametrize("backend", ["posix", "auto"])
def test_file_source_in_a_dali_pipeline(image_tree: Path, backend: str) -> None:
    pairs = list_labeled_files(image_tree)
    src = FileSource(image_tree, backend=backend, batch_size=4, threads=2)  # auto: 2 slices of 2 files

    @pipeline_def(batch_size=4, num_threads=1, device_id=None)
    def ours() -> Any:
        jpegs, labels = fn.external_source(source=src, num_outputs=2, batch=True, cycle="raise")
        return jpegs, fn.decoders.image(jpegs, device="cpu"), labels

    @pipeline_def(batch_size=4, num_threads=1, device_id=None)
    def theirs() -> Any:
        jpegs, labels = fn.readers.file(file_root=str(image_tree))
        return fn.decoders.image(jpegs, device="cpu"), labels

    a, b = ours(), theirs()
    a.build()
    b.build()
    seen = 0
    for _ in range(len(src)):
        raw, images, labels = a.run()
        ref_images, ref_labels = b.run()
        for i in range(len(raw)):
            path, label = pairs[seen]
            assert np.array(raw[i]).tobytes() == (image_tree / path).read_bytes()
            assert int(np.array(labels[i]).item()) == label == int(np.array(ref_labels[i]).item())
            got, want = np.array(labels[i]), np.array(ref_labels[i])
            assert (got.dtype, got.shape) == (want.dtype, want.shape) == (np.dtype(np.int32), (1,))
            np.testing.assert_array_equal(np.array(images[i]), np.array(ref_images[i]))
            seen += 1
    assert seen == len(pairs)
    with pytest.raises(StopIteration):
        a.run()
    a.reset()
    raw, _, labels = a.run()  # a new epoch after reset (cycle="raise" re-iterates the source)
    assert np.array(raw[0]).tobytes() == (image_tree / pairs[0][0]).read_bytes()


def test_shuffle_and_shards(image_tree: Path) -> None:
    n = len(list_labeled_files(image_tree))
    src = FileSource(image_tree, backend="posix", batch_size=4, shuffle=True, seed=3)
    first = [bytes(x) for batch in src for x in batch[0]]
    second = [bytes(x) for batch in src for x in batch[0]]
    assert len(first) == n and sorted(first) == sorted(second) and first != second
    parts = [FileSource(image_tree, backend="posix", shard_id=s, num_shards=2) for s in range(2)]
    assert sum(len(p.positions) for p in parts) == n
    assert set(parts[0].positions).isdisjoint(parts[1].positions)
    with pytest.raises(ValueError, match="shard_id 2"):
        FileSource(image_tree, shard_id=2, num_shards=2)


def test_cache_source_in_a_dali_pipeline(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    items = [{"image": rng.random((1, 8, 8, 8), dtype=np.float32), "label": rng.integers(0, 3, (1, 8, 8, 8),
              dtype=np.uint8)} for _ in range(5)]  # fmt: skip
    write_items(tmp_path / "c", items)
    src = CacheSource(tmp_path / "c", keys=["image", "label"], batch_size=2, backend="posix")

    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def pipe() -> Any:
        image, label = fn.external_source(
            source=src, num_outputs=2, batch=True, dtype=[dali.types.FLOAT, dali.types.UINT8]
        )
        return image * 2.0, label

    p = pipe()
    p.build()
    got_images, got_labels = [], []
    for _ in range(len(src)):
        images, labels = p.run()
        got_images += [np.array(images[i]) for i in range(len(images))]
        got_labels += [np.array(labels[i]) for i in range(len(labels))]
    np.testing.assert_allclose(np.stack(got_images), np.stack([it["image"] * 2 for it in items]), rtol=1e-6)
    np.testing.assert_array_equal(np.stack(got_labels), np.stack([it["label"] for it in items]))
    shuffled = CacheSource(tmp_path / "c", keys="label", batch_size=5, backend="posix", shuffle=True, seed=1)
    batch = next(iter(shuffled))
    order = shuffled._order.tolist()
    assert sorted(order) == list(range(5))
    np.testing.assert_array_equal(batch, np.stack([items[i]["label"] for i in order]))


@pytest.mark.loopdev
def test_bmap_source_reads_raw_ranges(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    from prep.mapping import build_bmap
    from prep.synth import image_tree

    fs = make_loopfs("ext4")
    root = image_tree(fs.mountpoint, classes=3, per_class=4, size=32, seed=1)
    (root / "class_empty_files_only").mkdir()
    (root / "class_empty_files_only" / "readme.txt").write_text("not an image")
    build_bmap(fs.mountpoint, tmp_path / "bmap.json")
    # closing releases the device/image descriptors, so the filesystem can be unmounted (even on a failure)
    with BmapSource(tmp_path / "bmap.json", batch_size=5, folder="train") as src:
        assert src.files == list_labeled_files(root)  # the folder with no image still takes label 0
        grown = root / src.files[7][0]
        with open(grown, "ab") as f:  # appended after mapping: read whole through the filesystem, not cut short
            f.write(b"appended" * 100)
        evict_tree(root)  # not in memory: read raw (a batch the page cache holds is read through the filesystem)
        seen = 0
        with pytest.warns(RuntimeWarning, match="changed since it was mapped"):
            for data, labels in src:
                for raw, label in zip(data, labels):
                    path, want = src.files[seen]
                    assert raw.tobytes() == (root / path).read_bytes() and int(label[0]) == want
                    seen += 1
        assert seen == len(src.files) == 12


@pytest.mark.loopdev
def test_bmap_source_reads_a_batch_in_memory_through_the_filesystem(
    make_loopfs: Callable[..., Any], tmp_path: Path
) -> None:
    """A batch whose files the page cache holds is read from there, exact, with no raw read: a file rewritten
    after mapping gives its new bytes even where raw reads of changed files are refused (fallback=False).
    Evicted, the same batch is read raw, and the raw read refuses that file."""
    from loaders.errors import BackendError
    from prep.mapping import build_bmap
    from prep.synth import image_tree

    fs = make_loopfs("ext4")
    root = image_tree(fs.mountpoint, classes=2, per_class=3, size=32, seed=3)
    build_bmap(fs.mountpoint, tmp_path / "bmap.json")
    opts = {"fallback": False}
    with BmapSource(tmp_path / "bmap.json", batch_size=6, folder="train", backend_options=opts) as src:
        changed = root / src.files[2][0]
        changed.write_bytes(changed.read_bytes()[::-1])  # same size, other bytes, after mapping
        want = [(root / p).read_bytes() for p, _ in src.files]  # every file in memory now
        data, labels = next(iter(src))
        assert [d.tobytes() for d in data] == want
        assert labels.ravel().tolist() == [x for _, x in src.files]
        evict_tree(root)
        with pytest.raises(BackendError, match="changed since it was mapped"):
            next(iter(src))


@pytest.mark.loopdev
def test_bmap_source_cold_epochs_read_batches_ahead_exactly(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    """An epoch whose first batch would wait on the disk keeps BMAP_COLD_BATCHES batches being read ahead; an
    epoch cut short, a reshuffled one and a reopened source still give their positions' files and labels."""
    import loaders.faces.dali as dali_mod
    from prep.mapping import build_bmap
    from prep.synth import image_tree

    fs = make_loopfs("ext4")
    root = image_tree(fs.mountpoint, classes=3, per_class=7, size=32, seed=2)
    build_bmap(fs.mountpoint, tmp_path / "bmap.json")
    with BmapSource(tmp_path / "bmap.json", batch_size=2, folder="train", shuffle=True, seed=4) as src:
        src._waits = lambda positions: True  # type: ignore[method-assign]  # as O_DIRECT reads: always cold
        assert src._depth() == dali_mod.BMAP_COLD_BATCHES

        def check(batch: Any, positions: list[int]) -> None:
            data, labels = batch
            assert [d.tobytes() for d in data] == [(root / src.files[i][0]).read_bytes() for i in positions]
            assert [int(x[0]) for x in labels] == [src.files[i][1] for i in positions]

        it = iter(src)
        check(next(it), src._order[:2].tolist())  # this epoch stops here, its batches ahead unused
        assert sorted(k for _, k in src._ahead) == list(range(1, 1 + dali_mod.BMAP_COLD_BATCHES))
        assert src._ahead_pool is not None and src._ahead_pool._max_workers == dali_mod.BMAP_COLD_THREADS == 2
        for _ in range(2):
            it = iter(src)
            got = list(it)
            order = src._order.tolist()
            for k, batch in enumerate(got):
                check(batch, order[2 * k : 2 * k + 2])
            assert sum(len(d) for d, _ in got) == len(src.files) == 21
        src.close()
        check(next(iter(src)), src._order[:2].tolist())


@pytest.mark.gpu
def test_cache_source_on_gpu(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    items = [{"image": np.full((4, 4), i, np.float32)} for i in range(3)]
    write_items(tmp_path / "c", items)
    batch = next(iter(CacheSource(tmp_path / "c", batch_size=3, device="cuda:0")))
    assert batch.is_cuda
    np.testing.assert_array_equal(batch.cpu().numpy(), np.stack([it["image"] for it in items]))


def _xnvme_tree(mnt: Path) -> dict[str, bytes]:
    """Class folders with a fragmented, a sparse and an odd-sized .jpg (bytes need not be JPEGs to be read)."""
    import os

    content: dict[str, bytes] = {}
    for c in ("a", "b"):
        (mnt / "train" / c).mkdir(parents=True)
    content.update(interleaved_appends(mnt, ["train/a/f0.jpg", "train/b/f1.jpg"], rounds=6))  # several extents
    with open(mnt / "train/a/sparse.jpg", "wb") as f:
        f.seek(8192 + 10)
        f.write(b"\x77" * 3000)
    content["train/a/sparse.jpg"] = bytes(8202) + b"\x77" * 3000
    content["train/b/odd.jpg"] = os.urandom(4097)
    (mnt / "train/b/odd.jpg").write_bytes(content["train/b/odd.jpg"])
    return content


@pytest.mark.xnvme
@pytest.mark.loopdev
@pytest.mark.parametrize("via", ["device", "image"])
def test_bmap_source_over_xnvme(make_loopfs: Callable[..., Any], tmp_path: Path, via: str) -> None:
    import os

    from loaders.backends.xnvme import load_capi
    from loaders.errors import PrepError
    from prep.mapping import build_bmap

    try:
        load_capi()
    except PrepError as exc:
        pytest.skip(f"xnvme unavailable here: {exc}")
    fs = make_loopfs("ext4", offset=1 << 20)
    content = _xnvme_tree(fs.mountpoint)
    build_bmap(fs.mountpoint, tmp_path / "bmap.json")
    # rewritten in place after mapping (same size, new mtime): must come through the filesystem, with a warning
    changed = os.urandom(4097)
    (fs.mountpoint / "train/b/odd.jpg").write_bytes(changed)
    content["train/b/odd.jpg"] = changed
    device = str(fs.image) if via == "image" else None  # the image: the filesystem starts 1 MiB into it
    with BmapSource(tmp_path / "bmap.json", backend="xnvme", batch_size=3, folder="train", device_path=device) as src:
        assert src.backend.xnvme.device_uri == (str(fs.image) if via == "image" else fs.device)
        want = [content["train/" + path] for path, _ in src.files]
        with pytest.warns(RuntimeWarning, match="odd.jpg: changed since it was mapped") as record:
            for _ in range(2):  # a second epoch: the same bytes, no second warning for the same file
                got = [d.tobytes() for data, _labels in src for d in data]
                assert got == want
        assert len(record) == 1


def test_bmap_source_refuses_backends_without_block_ranges(tmp_path: Path) -> None:
    from loaders.blockmap.bmap import BlockMap
    from loaders.errors import BackendError

    doc = {"files": {}, "root": str(tmp_path), "device": "/dev/null"}
    with pytest.raises(BackendError, match="backend 'posix' cannot read block ranges"):
        BmapSource(BlockMap(doc), backend="posix")


@pytest.mark.loopdev
def test_bmap_source_labels_equal_readers_file(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    """Empty class folders (one sorting first), stray files, mixed-case extensions, nested and hidden files:
    BmapSource lists what a real DALI readers.file pipeline lists, with the same labels, full map or flat."""
    from loaders.blockmap.bmap import FlatMapWarning
    from prep.mapping import build_bmap

    fs = make_loopfs("ext4")
    train = _tricky_tree(fs.mountpoint / "train")
    (train / "0empty").mkdir()  # sorts before every class: every later label depends on it
    want = _readers_file(train)
    assert {label for _, label in want} == {1, 3, 4, 5}  # 0empty and B0 (empty) take labels 0 and 2
    build_bmap(fs.mountpoint, tmp_path / "bmap.json")
    build_bmap(fs.mountpoint, tmp_path / "seed.json", fmt="seed")
    with BmapSource(tmp_path / "bmap.json", batch_size=4, folder="train") as src:
        assert src.files == want
        got = [(d.tobytes(), int(lab[0])) for data, labels in src for d, lab in zip(data, labels)]
        assert got == [((train / p).read_bytes(), label) for p, label in want]
    with pytest.warns(FlatMapWarning, match="first-extent-only"):  # the flat form, where the files are mounted
        flat = BmapSource(tmp_path / "seed.json", batch_size=4, root=fs.mountpoint, device_path=str(fs.image))
    with flat:
        assert flat.prefix == "train/" and flat.files == want
        got = [(d.tobytes(), int(lab[0])) for data, labels in flat for d, lab in zip(data, labels)]
        assert got == [((train / p).read_bytes(), label) for p, label in want]


@pytest.mark.loopdev
def test_flat_maps_research_and_seed_form(make_loopfs: Callable[..., Any], tmp_path: Path) -> None:
    """The research map (keys relative to the folder holding train/) and `prep bmap --format seed` load;
    without a mounted tree the bytes are whole blocks, as the research loaders read them."""
    import json

    from loaders.blockmap.bmap import BlockMap, FlatMapWarning
    from prep.mapping import build_bmap

    fs = make_loopfs("ext4")
    content = {f"train/{c}/{i}.JPEG": bytes([65 + i]) * (1000 + 4096 * i) for c in ("a", "b") for i in range(3)}
    for k, v in content.items():
        (fs.mountpoint / k).parent.mkdir(parents=True, exist_ok=True)
        (fs.mountpoint / k).write_bytes(v)
    build_bmap(fs.mountpoint, tmp_path / "seed.json", fmt="seed")
    seed = json.loads((tmp_path / "seed.json").read_text())
    assert set(seed) == set(content)
    with pytest.warns(FlatMapWarning):
        bm = BlockMap.load(tmp_path / "seed.json", device=fs.device)
    assert bm.flat and bm.entry("train/a/1.JPEG").size == 10 * 512  # whole LBAs: no size in a flat map
    with pytest.warns(FlatMapWarning), BmapSource(tmp_path / "seed.json", batch_size=6, device_path=fs.device) as src:
        assert src.files == [(k.removeprefix("train/"), int(k.split("/")[1] == "b")) for k in sorted(content)]
        for data, _labels in src:
            for d, (p, _) in zip(data, src.files):
                want = content["train/" + p]
                assert d.tobytes()[: len(want)] == want and len(d) % 512 == 0


def _plain_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """FileSource without io_uring: plain reads, threads and hints (as where the kernel has none)."""
    import loaders.reading.uring

    monkeypatch.setattr(loaders.reading.uring, "available", lambda: False)


@pytest.mark.parametrize("io_uring", [True, False])
@pytest.mark.parametrize("cold", [True, False])
def test_read_ahead_keeps_batches_and_epochs_exact(
    image_tree: Path, monkeypatch: pytest.MonkeyPatch, cold: bool, io_uring: bool
) -> None:
    """The next batches are read ahead where the epoch starts cold (io_uring reads in flight, or a thread),
    and read when asked where they are cached: an epoch cut short, a reshuffled epoch and a closed and
    reopened source still give exactly the files and labels of their positions."""
    import loaders.faces.dali as dali_mod
    import loaders.reading.uring

    if io_uring and not loaders.reading.uring.available():
        pytest.skip("no io_uring here (old kernel, seccomp or kernel.io_uring_disabled)")
    if not io_uring:
        _plain_reads(monkeypatch)
    monkeypatch.setattr(dali_mod, "_resident", lambda path: not cold)
    pairs = list_labeled_files(image_tree)
    src = FileSource(image_tree, batch_size=4, shuffle=True, seed=9)
    assert src.readahead

    def check(data: list[np.ndarray], labels: list[np.ndarray], positions: list[int]) -> None:
        assert [d.tobytes() for d in data] == [(image_tree / pairs[i][0]).read_bytes() for i in positions]
        assert [int(x[0]) for x in labels] == [pairs[i][1] for i in positions]

    it = iter(src)
    data, labels = next(it)  # cold: the second batch is now being read ahead; this epoch stops here
    check(data, labels, src._order[:4].tolist())
    assert bool(src._ahead) == cold
    assert (src._reader() is not None) == io_uring
    for _ in range(2):
        it = iter(src)
        got = [b for b in it]
        order = src._order.tolist()
        for k, (data, labels) in enumerate(got):
            check(data, labels, order[4 * k : 4 * k + 4])
        assert sum(len(d) for d, _ in got) == len(pairs)
    src.close()
    check(*next(iter(src)), src._order[:4].tolist())
    src.close()


def test_filesource_reads_files_that_changed_since_the_last_epoch_as_they_are(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second epoch reads with the sizes the first one found (io_uring: opens through the ring); files
    rewritten longer or shorter in between still come whole, as the filesystem holds them."""
    import loaders.reading.uring
    from prep.synth import image_tree as make

    if not loaders.reading.uring.available():
        pytest.skip("no io_uring here (old kernel, seccomp or kernel.io_uring_disabled)")
    import loaders.faces.dali as dali_mod

    tree = make(tmp_path / "tree", classes=2, per_class=3, size=16, seed=5)
    with FileSource(tree, batch_size=4) as src:
        first = [a.tobytes() for d, _ in src for a in d]  # warm: plain reads, which note the sizes
        assert (src._sizes == [len(b) for b in first]).all()
        paths = [tree / p for p, _ in src.files]
        paths[0].write_bytes(paths[0].read_bytes() + b"\0" * 999)
        paths[1].write_bytes(paths[1].read_bytes()[:10])
        monkeypatch.setattr(dali_mod, "_resident", lambda path: False)  # a cold epoch: through the ring
        opened: list[object] = []
        start = src._reader().start
        monkeypatch.setattr(src._reader(), "start", lambda ps, sizes=None: opened.append(sizes) or start(ps, sizes))
        second = [a.tobytes() for d, _ in src for a in d]
    assert second == [p.read_bytes() for p in paths]
    assert opened and all(sizes is not None for sizes in opened)  # every batch opened with the known sizes


@pytest.mark.parametrize("cold", [False, True])
def test_batches_are_read_ahead_on_a_thread_while_the_consumer_is_away(
    image_tree: Path, monkeypatch: pytest.MonkeyPatch, cold: bool
) -> None:
    """A consumer that spends more than IDLE_READS reads between batches (a pipeline that decodes) gets warm
    batches read ahead on the read-ahead thread, and a cold epoch's io_uring reads submitted there, exactly;
    one that comes back at once gets warm batches read when asked (a thread's Python would contend with its
    own)."""
    import time
    from concurrent.futures import Future

    import loaders.faces.dali as dali_mod

    pairs = list_labeled_files(image_tree)
    with FileSource(image_tree, batch_size=2, shuffle=True, seed=5) as src:
        monkeypatch.setattr(dali_mod, "_resident", lambda path: True)  # warm, so the consumer's pace is measured
        for _ in iter(src):
            time.sleep(0.03)  # decoding, elsewhere
        monkeypatch.setattr(dali_mod, "_resident", lambda path: not cold)
        it = iter(src)
        got, threaded = [], 0
        while (batch := next(it, None)) is not None:
            got += [(a.tobytes(), int(lab[0])) for a, lab in zip(*batch)]
            ahead = src._ahead.get((src.epoch, src._next))
            threaded += isinstance(ahead, Future) or isinstance(getattr(ahead, "batch", None), Future)
            time.sleep(0.03)
        assert got == [((image_tree / pairs[i][0]).read_bytes(), pairs[i][1]) for i in src._order.tolist()]
        assert threaded >= len(src) - 2  # every next batch is read (or submitted) on the thread
        assert src._consumer_idle()
        src._read_s, src._idle_s = 0.001, 0.0015  # back at once: read when asked
        assert not src._consumer_idle()
        src._read_s = 0.0  # no read measured yet
        assert not src._consumer_idle()


def test_warm_batches_are_read_on_one_thread_whatever_the_cores(image_tree: Path) -> None:
    from loaders.faces.dali import read_threads

    assert [read_threads(c) for c in (1, 2, 3, 4, 8, 64)] == [1] * 6
    with FileSource(image_tree) as src, FileSource(image_tree, threads=3) as three:
        assert (src.threads, three.threads) == (1, 3)


def test_cold_batches_read_on_more_threads(image_tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Plain reads: a batch whose first file is not in the page cache is read on COLD_READ_THREADS threads,
    in order."""
    import loaders.faces.dali as dali_mod

    _plain_reads(monkeypatch)
    pairs = list_labeled_files(image_tree)
    want = [(image_tree / p).read_bytes() for p, _ in pairs[:12]]
    for cold in (False, True):
        monkeypatch.setattr(dali_mod, "_resident", lambda path, cold=cold: not cold)
        with FileSource(image_tree, batch_size=12, threads=1) as src:
            data, labels = next(iter(src))
            assert [d.tobytes() for d in data] == want
            assert labels.ravel().tolist() == [x for _, x in pairs[:12]]
            assert src._pool_size == (dali_mod.COLD_READ_THREADS if cold else 0)
    assert dali_mod._resident(str(image_tree / pairs[0][0])) in (True, False)  # the real probe answers


def _evicted(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def test_hint_files_bring_cold_files_into_the_page_cache_up_to_the_limit(tmp_path: Path) -> None:
    """WILLNEED on each file in order until `limit` bytes: the kernel reads them in; files past it stay cold."""
    import time

    from loaders.faces.dali import _resident, hint_files

    paths = []
    for i in range(4):
        paths.append(tmp_path / f"f{i}.bin")
        paths[-1].write_bytes(np.random.default_rng(i).integers(0, 256, 64 << 10, dtype=np.uint8).tobytes())
    from loaders.backends.base import PageCacheProbe

    if not PageCacheProbe().available:
        pytest.skip("no cachestat(2) here: residency cannot be told")

    def cached(p: Path) -> bool:  # cachestat, which reads nothing in: `_resident`'s RWF_NOWAIT read of a page
        return cached_whole(str(p))  # not cached starts reading it in (cachestat counts it after, 20 of 20 on the
        # 2-core box), and half the time it is there before the probe returns: files past the limit warm up

    _evicted(paths)
    if any(cached(p) for p in paths):
        pytest.skip("eviction not honoured here")
    hint_files([str(p) for p in paths] + [str(tmp_path / "missing.bin")], limit=(64 << 10) * 2)  # 2 of 4 files
    deadline = time.monotonic() + 5
    while not all(_resident(str(p)) for p in paths[:2]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert [cached(p) for p in paths] == [True, True, False, False]


def test_filesource_hints_the_batches_after_the_one_read_ahead(
    image_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cold batches are hinted once each: a cold epoch's first HINT_BATCHES batches as it starts, then
    HINT_BATCHES ahead of the one read ahead; warm ones are not; the batches are the same either way."""
    import loaders.faces.dali as dali_mod

    _plain_reads(monkeypatch)
    pairs = list_labeled_files(image_tree)
    hinted: list[str] = []
    monkeypatch.setattr(dali_mod, "hint_files", lambda paths, limit=0: hinted.extend(paths))
    monkeypatch.setattr(loaders.faces.dali_base, "HINT_BATCHES", 2)
    got = {}
    for cold in (False, True):
        hinted.clear()
        monkeypatch.setattr(dali_mod, "_resident", lambda path, cold=cold: not cold)
        with FileSource(image_tree, batch_size=2) as src:
            got[cold] = list(src)
            order = [f"{image_tree}/{pairs[i][0]}" for i in src._order.tolist()]
        assert sorted(hinted) == (sorted(order) if cold else [])
    assert [[a.tobytes() for a in d] for d, _ in got[True]] == [[a.tobytes() for a in d] for d, _ in got[False]]


def test_filesource_hints_cold_batches_while_the_next_one_is_warm(
    image_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hinted batches come in and the next batch is warm: the hints go on to the cold batches after them (the
    disk kept busy), where they used to wait until a cold batch was next. Here batches 0-2 are warm, 3 on cold:
    batch 3 is hinted while batch 2 is next, and every cold file once."""
    import loaders.faces.dali as dali_mod

    _plain_reads(monkeypatch)
    pairs = list_labeled_files(image_tree)
    assert len(pairs) >= 10
    cold = {f"{image_tree}/{p}" for p, _ in pairs[6:]}
    hinted: list[str] = []
    monkeypatch.setattr(dali_mod, "hint_files", lambda paths, limit=0: hinted.extend(paths))
    monkeypatch.setattr(loaders.faces.dali_base, "HINT_BATCHES", 2)
    monkeypatch.setattr(dali_mod, "_resident", lambda path: path not in cold)
    with FileSource(image_tree, batch_size=2) as src:
        it = iter(src)
        next(it), next(it)  # batch 2 is next, warm: not read ahead
        assert not src._ahead and sorted(hinted) == sorted(f"{image_tree}/{p}" for p, _ in pairs[6:10])
        rest = []
        while (batch := next(it, None)) is not None:  # list(it) would start a new epoch: iter(src) is src's
            rest.append(batch)
    assert sorted(hinted) == sorted(cold) and len(rest) == len(src) - 2


def test_a_cold_epoch_never_probes_an_unhinted_file_on_the_pipeline_thread(
    image_tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening a cold file reads its inode from the disk: in a cold epoch, the pipeline's thread probes only
    files already hinted (the next batch's ends); the hints go on without it, every file hinted once."""
    import threading

    import loaders.faces.dali as dali_mod

    _plain_reads(monkeypatch)
    pairs = list_labeled_files(image_tree)
    hinted: list[str] = []
    main = threading.get_ident()
    unhinted_probes: list[str] = []

    def resident(path: str) -> bool:
        if threading.get_ident() == main and path not in hinted:
            unhinted_probes.append(path)
        return path in hinted  # a hinted file is in at once; the rest is cold

    monkeypatch.setattr(dali_mod, "hint_files", lambda paths, limit=0: hinted.extend(paths))
    monkeypatch.setattr(loaders.faces.dali_base, "HINT_BATCHES", 2)
    monkeypatch.setattr(dali_mod, "_resident", resident)
    with FileSource(image_tree, batch_size=2) as src:
        it = iter(src)
        first = next(it)
        src._pool_hints().submit(lambda: None).result()  # the first hints are in
        unhinted_probes.clear()  # batch 0 itself is probed to tell the epoch cold
        got = [first]
        while (batch := next(it, None)) is not None:  # not list(it): iter(src) starts a new epoch
            got.append(batch)
        src._settle()
        order = [f"{image_tree}/{pairs[i][0]}" for i in src._order.tolist()]
    assert [order.index(p) for p in unhinted_probes] == []
    assert sorted(hinted) == sorted(order[2:]) or sorted(hinted) == sorted(order)
    assert [a.tobytes() for d, _ in got for a in d] == [Path(p).read_bytes() for p in order]


def test_resident_tells_an_evicted_file_from_one_read(tmp_path: Path) -> None:
    """The real probe (RWF_NOWAIT reads, cachestat where the kernel has none): evicted -> False, read -> True."""
    from loaders.faces.dali import _resident

    path = tmp_path / "f.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 3 << 14, dtype=np.uint8).tobytes())
    for _ in range(5):  # the probe reads a missing page in, and on a fast disk may find it there: again
        _evicted([path])
        if not _resident(str(path)):
            break
    else:
        pytest.skip("5 tries, the page there each time: eviction not honoured, or the probe read it in that fast")
    path.read_bytes()
    assert _resident(str(path))
    assert _resident(str(tmp_path / "missing.bin"))  # the read says what is wrong with it
    (tmp_path / "empty.bin").write_bytes(b"")
    assert _resident(str(tmp_path / "empty.bin"))
