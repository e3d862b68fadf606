"""prep cache: bit-exact against MONAI's own head, resume after kill -9, lock, stale/force, quarantine, disk full."""

from __future__ import annotations

import fcntl
import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from cacheutil import REPO, SPHERES, slow_pipeline
from typer.testing import CliRunner

from loaders.cache.format import PreparedCache, check
from loaders.cache.meta import line_meta
from loaders.cache.spec import JOURNAL_DIR
from prep.cache import load_datalist, prepare_cache
from prep.cache_verify import verify_cache
from prep.cli import app
from prep.errors import LockedError, PrepError, StaleError
from prep.journal import write_plan
from prep.pipeline import load_pipeline

# Keeps label dtype (dtype=None: uint8 stays uint8) and adds a list output, to test both through the cache.
NESTED_PIPELINE = """
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, MapTransform, Orientationd, RandFlipd

class AddViews(MapTransform):  # a MONAI Transform, so the cache runs it (a plain function would end the head)
    def __call__(self, d):
        d = dict(d)
        d["views"] = [d["image"][:, :8], {"top": d["label"][:, -4:]}]
        return d

transform = Compose([
    LoadImaged(keys=["image", "label"], dtype=None),
    EnsureChannelFirstd(keys=["image", "label"]),
    Orientationd(keys=["image", "label"], axcodes="LPS"),
    AddViews(keys=["image"]),
    RandFlipd(keys=["image"], prob=0.5),
])
"""


def _pipeline_file(tmp_path: Path, text: str, name: str = "pipe.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def _to_numpy(t: object) -> np.ndarray:
    return np.asarray(t.as_tensor().numpy() if hasattr(t, "as_tensor") else t)  # type: ignore[attr-defined]


def _read(entry: object) -> np.ndarray:
    e = entry  # TensorEntry
    with open(e.shard, "rb") as f:  # type: ignore[attr-defined]
        f.seek(e.offset)  # type: ignore[attr-defined]
        raw = f.read(e.nbytes)  # type: ignore[attr-defined]
    return np.frombuffer(raw, dtype=e.dtype).reshape(e.shape)  # type: ignore[attr-defined]


def test_cache_equals_monai_head_bit_exact(tmp_path: Path, nifti_dataset: Path) -> None:
    pipe_path = _pipeline_file(tmp_path, NESTED_PIPELINE)
    out = tmp_path / "cache"
    summary = prepare_cache(nifti_dataset, pipe_path, out, workers=1, processes=False)
    assert summary.n_items == 6 and not summary.quarantined
    cache = PreparedCache(out)
    head = load_pipeline(pipe_path).head_compose()
    assert cache.manifest["head_length"] == 4 and cache.manifest["tail"] == ["RandFlipd(keys=('image',))"]
    for item, (_, entry) in enumerate(load_datalist(nifti_dataset)):
        expected = head(dict(entry))
        got = {e.key: _read(e) for e in cache.entries(item)}
        assert set(got) == {"image", "label", "views/0", "views/1/top"}
        views = expected["views"]
        pairs = [("image", expected["image"]), ("label", expected["label"]), ("views/0", views[0])]
        for key, tensor in [*pairs, ("views/1/top", views[1]["top"])]:
            want = _to_numpy(tensor)
            assert got[key].dtype == want.dtype and np.array_equal(got[key], want), key
        assert got["label"].dtype == np.uint8
        meta = cache.meta(item)
        assert meta["source"] == entry
        metas = line_meta(meta)  # meta values are type-tagged in the line (loaders.cache.meta decodes them)
        for key in ("image", "label"):
            assert np.array_equal(np.asarray(metas[key]["affine"]), expected[key].affine.numpy())
            assert np.array_equal(np.asarray(metas[key]["original_affine"]), expected[key].meta["original_affine"])
            assert metas[key]["filename_or_obj"] == entry[key]
        assert meta["applied_operations"]["image"][0]["class"] == "Orientation"
    assert verify_cache(out) == []
    if summary.bmap is not None:  # the shards' block map, where the filesystem has FIEMAP
        assert sorted(json.loads(summary.bmap.read_text())["files"]) == sorted(cache.manifest["shards"])
    else:
        assert summary.bmap_note
    # raw tensor bytes vs disk: only alignment padding on top
    assert summary.bytes_on_disk >= summary.tensor_bytes > 0


COUNTING_PIPELINE = """
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, MapTransform, RandFlipd

class Count(MapTransform):  # each run of the head on an item: one line in LOG
    def __call__(self, d):
        with open(LOG, "a") as f:
            f.write(str(d["image"].meta["filename_or_obj"]) + "\\n")
        return d

transform = Compose([LoadImaged(keys=["image"]), EnsureChannelFirstd(keys=["image"]), Count(keys=["image"]),
                     RandFlipd(keys=["image"], prob=0.5)])
"""


@pytest.mark.parametrize(("workers", "processes"), [(1, False), (2, False), (2, True)])
def test_each_item_is_prepared_once_the_probes_too(
    tmp_path: Path, nifti_dataset: Path, workers: int, processes: bool
) -> None:
    """The items the auto choice times its head on (while worker processes start, where asked for) are prepared
    for real (journaled, in the cache) and their head is not run again by the tasks."""
    log = tmp_path / "heads.log"
    pipe = _pipeline_file(tmp_path, f"LOG = {str(log)!r}\n" + COUNTING_PIPELINE)
    summary = prepare_cache(nifti_dataset, pipe, tmp_path / "c", workers=workers, processes=processes)
    assert summary.n_items == 6 and summary.n_new == 6 and summary.n_resumed == 0 and not summary.quarantined
    runs = log.read_text().splitlines()
    assert len(runs) == 6 and len(set(runs)) == 6, runs
    cache = PreparedCache(tmp_path / "c")
    head = load_pipeline(pipe).head_compose()
    for item, (_, entry) in enumerate(load_datalist(nifti_dataset)):
        (e,) = cache.entries(item)
        assert np.array_equal(_read(e), _to_numpy(head(dict(entry))["image"]))


@pytest.mark.parametrize("processes", [False, True])
def test_sampling_sets_made_by_the_workers_equal_the_pass_after_the_commit(
    tmp_path: Path, nifti_dataset: Path, processes: bool
) -> None:
    """A tail that starts with a label-driven crop: each worker makes its items' sets beside them, and the
    store written after the commit is byte for byte the one `prep sampling --force` makes from the cache."""
    from prep.sampling import ensure_sets

    out = tmp_path / "c"
    summary = prepare_cache(nifti_dataset, SPHERES, out, workers=2, processes=processes)
    assert "sampling sets: 6 items for RandCropByPosNegLabeld, made by the workers" in summary.sampling
    (folder,) = (p for p in (out / "sampling").iterdir())  # no file of the workers' sets left beside it
    made = {f.name: f.read_bytes() for f in folder.iterdir()}
    ensure_sets(out, load_pipeline(SPHERES).tail, force=True)  # the pass after the commit, from the cache
    assert {f.name: f.read_bytes() for f in folder.iterdir()} == made
    assert verify_cache(out) == []


def test_sampling_sets_too_large_to_send_back_are_made_after_the_commit(
    tmp_path: Path, nifti_dataset: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import prep.worker

    monkeypatch.setattr(prep.worker, "WORKER_SETS_MAX_BYTES", 64)  # smaller than any item's sets here
    summary = prepare_cache(nifti_dataset, SPHERES, tmp_path / "c", workers=2, processes=False)
    assert summary.sampling.startswith("sampling sets: 6 items") and "by the workers" not in summary.sampling
    assert verify_cache(tmp_path / "c") == []


SLOW_PIPELINE = slow_pipeline(0.4)


def _journaled(out: Path) -> dict[int, dict]:
    done: dict[int, dict] = {}
    for path in (out / JOURNAL_DIR).glob("*.jsonl"):
        for line in path.read_bytes().splitlines():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            done.setdefault(record["item"], record)
    return done


@pytest.mark.slow
def test_resume_after_kill9_skips_finished_items(tmp_path: Path) -> None:
    from prep.synth import nifti_dataset

    datalist = nifti_dataset(tmp_path / "data", count=12, size=16, seed=1)
    pipe_path = _pipeline_file(tmp_path, SLOW_PIPELINE)
    out = tmp_path / "cache"
    cmd = [sys.executable, "-m", "prep", "cache", str(datalist), "--pipeline", str(pipe_path), "--output", str(out),
           "--workers", "2"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(_journaled(out)) < 3 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)  # let worker processes notice their parent is gone
    first = _journaled(out)
    assert 3 <= len(first) < 12, "the kill should land mid-run"
    assert not (out / "manifest.json").exists()
    again = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"{len(first)} resumed from the journal" in again.stdout
    cache = PreparedCache(out)
    assert len(cache) == 12
    for item, record in first.items():  # finished items were kept where the first run wrote them
        entries = {e.key: e for e in cache.entries(item)}
        for t in record["tensors"]:
            assert entries[t["key"]].shard == str(out / record["shard"])
            assert entries[t["key"]].offset == t["offset"]
    head = load_pipeline(pipe_path).head_compose()
    for item, (_, entry) in enumerate(load_datalist(datalist)):
        expected = head(dict(entry))
        for e in cache.entries(item):
            assert np.array_equal(_read(e), _to_numpy(expected[e.key]))
    assert verify_cache(out) == []
    assert not (out / JOURNAL_DIR).exists()


def test_corrupt_byte_detected_by_verify_and_at_load(tmp_path: Path, nifti_dataset: Path) -> None:
    out = tmp_path / "cache"
    prepare_cache(nifti_dataset, SPHERES, out, workers=1, processes=False)
    cache = PreparedCache(out)
    victim = cache.entries(3)[1]
    with open(victim.shard, "r+b") as f:
        f.seek(victim.offset + 100)
        byte = f.read(1)
        f.seek(victim.offset + 100)
        f.write(bytes([byte[0] ^ 0x10]))
    bad = verify_cache(out)
    assert [(b.item, b.key) for b in bad] == [(3, victim.key)]
    result = CliRunner().invoke(app, ["verify", str(out)])
    assert result.exit_code == 1, result.output
    assert "item 3" in result.output and "1 bad tensors" in result.output
    with pytest.raises(PrepError, match="checksum"):
        check(victim, _read(victim))


def test_second_run_refused_while_locked(tmp_path: Path, nifti_dataset: Path) -> None:
    out = tmp_path / "cache"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         f"fd = os.open({str(out / '.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "os.write(fd, f'{os.getpid()}\\n'.encode())\n"
         "print('locked', flush=True)\n"
         "time.sleep(60)\n"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockedError, match=f"PID {holder.pid}"):
            prepare_cache(nifti_dataset, SPHERES, out, workers=1, processes=False)
    finally:
        holder.kill()
        holder.communicate()
    fd = os.open(out / ".lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the refused run did not leave the lock held
    finally:
        os.close(fd)


def test_stale_pipeline_refused_datalist_kept_then_force(tmp_path: Path, nifti_dataset: Path) -> None:
    out = tmp_path / "cache"
    prepare_cache(nifti_dataset, SPHERES, out, workers=1, processes=False)
    first = json.loads((out / "manifest.json").read_text())["fingerprint"]
    changed = _pipeline_file(tmp_path, SPHERES.read_text().replace("pixdim=(1.0, 1.0, 1.0)", "pixdim=(2.0, 2.0, 2.0)"))
    with pytest.raises(StaleError, match="pipeline head settings changed.*--force"):
        prepare_cache(nifti_dataset, changed, out, workers=1, processes=False)
    smaller = tmp_path / "smaller.json"
    doc = json.loads(nifti_dataset.read_text())
    doc["training"] = [{k: str(nifti_dataset.parent / v) for k, v in e.items()} for e in doc["training"][:4]]
    smaller.write_text(json.dumps(doc))
    kept = prepare_cache(smaller, SPHERES, out, workers=1, processes=False)  # only the datalist changed
    assert (kept.n_items, kept.n_new, kept.n_kept, kept.n_dropped) == (4, 0, 4, 2)
    summary = prepare_cache(nifti_dataset, changed, out, workers=1, processes=False, force=True)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["fingerprint"] != first and summary.n_new == 6
    assert PreparedCache(out).entries(0)[0].shape != (1, 32, 32, 32)  # resampled to 2 mm now
    assert verify_cache(out) == []


def test_stale_partial_cache_refused(tmp_path: Path, nifti_dataset: Path) -> None:
    out = tmp_path / "cache"
    out.mkdir()
    write_plan(out, {"fingerprint": "0" * 64, "head": ["LoadImaged(keys=('image',))"], "datalist_hash": "x",
                     "n_datalist": 6, "sections": ["training"], "versions": {}})  # fmt: skip
    with pytest.raises(StaleError, match="partial cache"):
        prepare_cache(nifti_dataset, SPHERES, out, workers=1, processes=False)


def _bad_inputs(root: Path) -> Path:
    """A datalist of two good pairs and one pair per kind of bad input."""
    from prep.synth import nifti_dataset

    datalist = nifti_dataset(root, count=2, size=16, seed=2)
    good_label = "labelsTr/case_00000.nii.gz"
    data = np.random.default_rng(0).random((16, 16, 16)).astype(np.float32)
    raw = (root / "imagesTr" / "case_00001.nii.gz").read_bytes()
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x04
    (root / "flip.nii.gz").write_bytes(bytes(flipped))
    (root / "trunc.nii.gz").write_bytes(raw[: len(raw) // 2])
    (root / "empty.nii.gz").write_bytes(b"")
    nib.save(nib.Nifti1Image(data, np.eye(4), header=nib.Nifti1Header(endianness=">")), root / "bigend.nii.gz")
    nib.save(nib.Nifti1Image(data.astype(np.complex64), np.eye(4)), root / "complex.nii.gz")
    rgb = np.zeros((16, 16, 16), dtype=[("R", "u1"), ("G", "u1"), ("B", "u1")])
    nib.save(nib.Nifti1Image(rgb, np.eye(4)), root / "rgb.nii.gz")
    doc = json.loads(datalist.read_text())
    for name in ("flip", "trunc", "empty", "missing", "bigend", "complex", "rgb"):
        doc["training"].append({"image": f"{name}.nii.gz", "label": good_label})
    doc["training"].append({"image": "imagesTr/case_00001.nii.gz"})  # sound file, but the head needs a label
    datalist.write_text(json.dumps(doc))
    with gzip.open(root / "flip.nii.gz") as f, pytest.raises((OSError, EOFError)):
        f.read()  # the flipped byte really is inside the stream
    return datalist


def test_quarantine_each_bad_input_kind(tmp_path: Path) -> None:
    datalist = _bad_inputs(tmp_path / "data")
    out = tmp_path / "cache"
    summary = prepare_cache(datalist, SPHERES, out, workers=1, processes=False)
    assert summary.n_items == 3  # the two good pairs and the big-endian image: MONAI loads it fine
    reasons = {Path(q["path"]).name: q["reason"] for q in summary.quarantined}
    names = ("flip", "trunc", "empty", "missing", "complex", "rgb")
    assert set(reasons) == {f"{n}.nii.gz" for n in names} | {"case_00001.nii.gz"}
    assert "label" in reasons["case_00001.nii.gz"]  # the head's own error on this item, its root cause
    assert "CRC" in reasons["flip.nii.gz"] and "gzip" in reasons["trunc.nii.gz"]
    assert reasons["empty.nii.gz"] == "empty file" and reasons["missing.nii.gz"] == "missing file"
    assert "complex64" in reasons["complex.nii.gz"] and "structured" in reasons["rgb.nii.gz"]
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["quarantined"]) == 7 and manifest["n_items"] == 3
    missing = next(q for q in manifest["quarantined"] if q["path"].endswith("missing.nii.gz"))
    assert missing["source"]["image"] == missing["path"] and missing["reason"] == "missing file"
    assert [PreparedCache(out).meta(i)["source"]["image"] for i in range(2)] == [
        str(tmp_path / "data" / "imagesTr" / f"case_{i:05d}.nii.gz") for i in range(2)
    ]


@pytest.mark.slow
def test_cli_quarantine_exit_code_and_count(tmp_path: Path) -> None:
    datalist = _bad_inputs(tmp_path / "data")
    out = tmp_path / "cache"
    args = ["cache", str(datalist), "--pipeline", str(SPHERES), "--output", str(out), "--workers", "1", "--verify"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "7 items quarantined" in result.output and "flip.nii.gz" in result.output
    assert PreparedCache(out).n_items == 3


def test_scheduler_address_of_existing_cluster(tmp_path: Path, nifti_dataset: Path) -> None:
    from distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, protocol="tcp",
                      dashboard_address=None) as cluster:  # fmt: skip
        summary = prepare_cache(nifti_dataset, SPHERES, tmp_path / "cache", scheduler=cluster.scheduler_address)
    assert summary.n_items == 6 and verify_cache(tmp_path / "cache") == []


def test_non_cache_output_refused(tmp_path: Path, nifti_dataset: Path) -> None:
    (tmp_path / "precious.txt").write_text("x")
    with pytest.raises(PrepError, match="not a blockprep cache"):
        prepare_cache(nifti_dataset, SPHERES, tmp_path, workers=1, processes=False)


@pytest.mark.loopdev
def test_disk_full_is_clear_and_resumable(tmp_path: Path, nifti_dataset: Path, make_loopfs: object) -> None:
    fs = make_loopfs("ext4", size_mb=8)  # type: ignore[operator]
    filler = fs.mountpoint / "filler"
    free = shutil.disk_usage(fs.mountpoint).free
    with open(filler, "wb") as f:  # leave room for about two items (~0.45 MB each after resampling)
        f.write(b"\0" * max(0, free - 1_000_000))
        os.fsync(f.fileno())
    out = fs.mountpoint / "cache"
    with pytest.raises(PrepError, match="no space left"):
        prepare_cache(nifti_dataset, SPHERES, out, workers=1, processes=False, shard_size=1 << 16)
    assert not (out / "manifest.json").exists()
    partial = _journaled(out)
    filler.unlink()
    summary = prepare_cache(nifti_dataset, SPHERES, out, workers=1, processes=False, shard_size=1 << 16)
    assert summary.n_items == 6 and summary.n_resumed == len(partial) > 0
    assert verify_cache(out) == []


@pytest.mark.loopdev
def test_resume_after_full_disk_finishes_with_default_shards(
    tmp_path: Path, nifti_dataset: Path, make_loopfs: object
) -> None:
    """Preallocation follows what is left to write and the free space: 1 GiB shards on a 16 MB filesystem."""
    fs = make_loopfs("ext4", size_mb=16)  # type: ignore[operator]
    filler = fs.mountpoint / "filler"
    with open(filler, "wb") as f:  # room for about two items
        f.write(b"\0" * max(0, shutil.disk_usage(fs.mountpoint).free - 1_200_000))
        os.fsync(f.fileno())
    out = fs.mountpoint / "cache"
    with pytest.raises(PrepError, match="no space left"):
        prepare_cache(nifti_dataset, SPHERES, out, workers=1, batch_size=1)
    partial = _journaled(out)
    assert partial, "the items that fitted are journaled"
    filler.unlink()
    assert shutil.disk_usage(fs.mountpoint).free < 256 << 20  # less than one old preallocation step
    summary = prepare_cache(nifti_dataset, SPHERES, out, workers=1, batch_size=1)
    assert summary.n_items == 6 and summary.n_resumed == len(partial)
    assert verify_cache(out) == []


DYING_PIPELINE = """
import os
from pathlib import Path
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, MapTransform, RandFlipd

MARK = Path(__file__).with_name("died-once")

class DieOnce(MapTransform):
    def __call__(self, d):
        if "case_00003" in d["image"].meta["filename_or_obj"] and not MARK.exists():
            MARK.write_text("the worker preparing case 3 died here")
            os._exit(1)
        return d

transform = Compose([LoadImaged(keys=["image", "label"]), EnsureChannelFirstd(keys=["image", "label"]),
                     DieOnce(keys=["image"]),
                     RandFlipd(keys=["image"], prob=0.5)])
"""


@pytest.mark.slow
def test_a_dying_worker_is_replaced_and_the_cache_completes(tmp_path: Path, nifti_dataset: Path) -> None:
    pipe_path = _pipeline_file(tmp_path, DYING_PIPELINE)
    out = tmp_path / "cache"
    summary = prepare_cache(nifti_dataset, pipe_path, out, workers=2, batch_size=2, processes=True)
    assert (tmp_path / "died-once").exists(), "a worker process should have died mid-run"
    assert summary.n_items == 6 and not summary.quarantined
    cache = PreparedCache(out)
    head = load_pipeline(pipe_path).head_compose()
    for item, (_, entry) in enumerate(load_datalist(nifti_dataset)):
        expected = head(dict(entry))
        for e in cache.entries(item):
            assert np.array_equal(_read(e), _to_numpy(expected[e.key]))
    assert verify_cache(out) == []


RANDOM_CALLABLE_PIPELINE = """
import numpy as np
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandFlipd

def jitter(d):  # random, though no MONAI Randomizable says so
    d = dict(d)
    d["image"] = d["image"] + float(np.random.uniform(1.0, 2.0))
    return d

transform = Compose([LoadImaged(keys=["image", "label"]), EnsureChannelFirstd(keys=["image", "label"]), jitter,
                     RandFlipd(keys=["image"], prob=0.5)])
"""


def test_random_plain_callable_is_never_cached(tmp_path: Path, nifti_dataset: Path) -> None:
    pipe_path = _pipeline_file(tmp_path, RANDOM_CALLABLE_PIPELINE)
    out = tmp_path / "cache"
    args = ["cache", str(nifti_dataset), "--pipeline", str(pipe_path), "--output", str(out), "--workers", "1"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "head: LoadImaged" in result.output and "transform 2 (jitter): not a MONAI Transform" in result.output
    cache = PreparedCache(out)
    assert cache.manifest["head_length"] == 2 and cache.manifest["tail"][0] == "jitter()"
    assert "jitter" in cache.manifest["head_end"]
    from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged

    plain = Compose([LoadImaged(keys=["image", "label"]), EnsureChannelFirstd(keys=["image", "label"])])
    for item, (_, entry) in enumerate(load_datalist(nifti_dataset)):
        got = {e.key: _read(e) for e in cache.entries(item)}
        assert np.array_equal(got["image"], _to_numpy(plain(dict(entry))["image"]))  # no frozen draw in it


NIBABEL_PIPELINE = """
from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged, RandFlipd
transform = Compose([LoadImaged(keys=["image"]), EnsureChannelFirstd(keys=["image"]), RandFlipd(keys=["image"])])
"""


def test_nibabel_test_volumes_big_endian_included_equal_monai(tmp_path: Path) -> None:
    """nibabel's real test volumes (big-endian, 4D, NIfTI-2, non-identity affines), as MONAI loads them."""
    from monai.transforms import Compose, EnsureChannelFirstd, LoadImaged
    from nibabel.testing import data_path

    names = [p.name for p in sorted(Path(data_path).glob("*.nii*")) if not p.name.endswith(".dconn.nii")]
    big = [n for n in names if nib.load(Path(data_path) / n).header.get_data_dtype().byteorder == ">"]
    assert len(names) >= 7 and len(big) >= 3
    datalist = tmp_path / "dataset.json"
    datalist.write_text(json.dumps({"training": [{"image": str(Path(data_path) / n)} for n in names]}))
    out = tmp_path / "cache"
    summary = prepare_cache(datalist, _pipeline_file(tmp_path, NIBABEL_PIPELINE), out, workers=1)
    assert summary.quarantined == [] and summary.n_items == len(names)
    head = Compose([LoadImaged(keys=["image"]), EnsureChannelFirstd(keys=["image"])])
    cache = PreparedCache(out)
    for item, name in enumerate(names):
        want = head({"image": str(Path(data_path) / name)})["image"]
        (entry,) = cache.entries(item)
        assert np.array_equal(_read(entry), _to_numpy(want), equal_nan=True), name  # NaN voxels in one file
        assert np.array_equal(np.asarray(line_meta(cache.meta(item))["image"]["affine"]), want.affine.numpy()), name


def test_worker_processes_start_before_the_probe_where_they_will_be_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """Processes asked for start while this process probes; auto starts them early only on a machine of 8 cores
    or more with 4 workers or more; never for threads, a scheduler's run or a run no larger than the workers."""
    from types import SimpleNamespace

    from monai.transforms import LoadImaged

    import prep.cache as cache_module

    def run(workers: int, processes: bool | None, scheduler: str | None = None) -> SimpleNamespace:
        pipe = SimpleNamespace(head=[LoadImaged(keys="image")])
        return SimpleNamespace(workers=workers, processes=processes, scheduler=scheduler, pipe=pipe)

    start_early = cache_module._start_early
    for cores, expected_auto in ((2, False), (16, True)):
        monkeypatch.setattr(cache_module, "local_cores", lambda cores=cores: cores)
        assert start_early(run(2, True), 10) and not start_early(run(2, False), 10)
        assert start_early(run(4, None), 10) is expected_auto and not start_early(run(2, None), 10)
        assert not start_early(run(4, True, "tcp://host:8786"), 10) and not start_early(run(4, True), 4)
