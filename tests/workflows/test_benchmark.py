"""Smoke tests of the benchmark (so it cannot rot) and tests of its pure parts; no timing is asserted."""

from __future__ import annotations

import csv
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from seedlines import SEED_LINES

from workflows import benchmark
from workflows.bench import ceilings, report
from workflows.bench.core import Options, Result, Unavailable, cycle, evict, nbytes_of, start_pass

PIPELINE = Path(benchmark.__file__).parent / "pipelines" / "spheres.py"


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory, nifti_dataset: Path, image_tree: Path) -> Path:
    """A demo-layout folder (nifti/, images/train, cache/) over the shared synthetic fixtures."""
    from prep.cache import prepare_cache

    root = tmp_path_factory.mktemp("demo")
    (root / "nifti").symlink_to(nifti_dataset.parent)
    (root / "images").mkdir()
    (root / "images" / "train").symlink_to(image_tree)
    prepare_cache(nifti_dataset, PIPELINE, root / "cache", workers=1, processes=False)
    return root


def _rows(out: Path) -> dict[str, dict[str, str]]:
    with open(out / "bench.csv") as f:
        return {r["name"]: r for r in csv.DictReader(f)}


def test_all_runs_every_way_that_applies(demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    status = benchmark.main(["all", "--data", str(demo), "--batchsize", "2", "--batches", "2", "--warm",
                             "--out", str(out)])  # fmt: skip
    text = capsys.readouterr().out
    assert status == 0, text
    rows = _rows(out)
    from loaders.deps import has

    expected = ["blockprep prepared (posix)", "blockprep prepared (direct)", report.PERSISTENT,
                "monai Dataset (NIfTI + head)", "monai CacheDataset", "ceiling np.fromfile (warm)"]  # fmt: skip
    if has("nvidia.dali"):  # the DALI ways (make install brings DALI; without it they say so in one line)
        expected += ["dali readers.numpy (.npy)", "dali readers.file", "python-file external_source",
                     "blockprep dali FileSource (auto)"]  # fmt: skip
    for name in expected:
        assert name in rows, text
    # every way read the same volumes: the same delivered bytes, 4 items each
    volumes = {n: r for n, r in rows.items() if r["data"] == "volumes" and r["kind"] != "ceiling"}
    assert len({r["nbytes"] for r in volumes.values()}) == 1, volumes
    assert {r["items"] for r in rows.values()} == {"4"}
    assert float(rows[report.PERSISTENT]["x_peer"]) == pytest.approx(1.0)
    assert float(rows["ceiling np.fromfile (warm)"]["x_ceiling"]) == pytest.approx(1.0)
    # ways that cannot run on a CPU-only machine say so in one line each, and the run went on
    assert text.count("unavailable: gds-dataset:") == 1
    doc = json.loads((out / "bench.json").read_text())
    assert doc["environment"]["mode"] == "warm" and "gds-dataset" in doc["unavailable"]
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    header = next(line for line in text.splitlines() if line.startswith("name"))
    assert "items/s" in header and "GB/s" in header and "x ceiling" in header and "x peer" in header
    assert f"x peer: against {report.PERSISTENT} (volumes)" in text


def test_single_way_cold_reports_its_ceiling(demo: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = benchmark.main(["prepared", "--cache", str(demo / "cache"), "--backend", "posix", "--cold",
                             "--batchsize", "3", "--batches", "2", "--out", str(tmp_path)])  # fmt: skip
    text = capsys.readouterr().out
    assert status == 0, text
    rows = _rows(tmp_path)
    shards = len(list((demo / "cache" / "shards").iterdir()))
    assert rows["blockprep prepared (posix)"]["note"].startswith(f"fadvise({shards} files)")
    assert rows["O_DIRECT x16, a request a tensor"]["x_ceiling"] == "1.0"
    assert "ceiling np.fromfile (warm)" in rows  # every ceiling of the data, the reference one first
    assert int(rows["blockprep prepared (posix)"]["items"]) == 6


def test_unavailable_way_prints_one_line_and_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = benchmark.main(["gds-dataset", "--datalist", str(tmp_path / "x.json"), "--out", str(tmp_path)])
    lines = [line for line in capsys.readouterr().out.splitlines() if "unavailable: gds-dataset" in line]
    assert status == 1 and len(lines) == 1 and "cuda" in lines[0]


def test_research_readers_deliver_decoded_images(image_tree: Path, tmp_path: Path) -> None:
    from workflows.bench import research

    opts = Options(batchsize=5, batches=3, cold=False, work=tmp_path)
    files, labels = research.tree_files(image_tree)
    assert labels == sorted(labels) and len(set(labels)) == 3
    dali = research.dali_file(image_tree, opts)
    python = research.python_file(image_tree, opts)
    assert dali.nbytes == python.nbytes == 15 * 32 * 32 * 3  # 15 decoded 32x32 RGB images each
    with pytest.raises(Unavailable, match="no such folder"):
        research.tree_files(tmp_path / "missing")


def test_dali_numpy_reads_the_cache_exports(demo: Path, tmp_path: Path) -> None:
    from loaders.cache.format import PreparedCache
    from workflows.bench import peers

    npy = peers.export_npy(demo / "cache", tmp_path / "npy")
    cache = PreparedCache(demo / "cache")
    first = cache.entries(0)[0]
    assert np.load(npy[first.key][0]).shape == first.shape
    result = peers.dali_numpy(npy, Options(batchsize=2, batches=3, cold=False, work=tmp_path))
    assert result.nbytes == sum(e.nbytes for i in range(6) for e in cache.entries(i))


def test_ceilings_read_exactly_the_tensor_bytes(demo: Path) -> None:
    items = ceilings.cache_items(demo / "cache")
    opts = Options(batchsize=3, batches=2, cold=True)
    direct = ceilings.direct(items, opts, "volumes")
    warm = ceilings.fromfile(items, opts, "volumes")
    assert direct.nbytes == warm.nbytes == sum(s.nbytes for item in items for s in item)
    with pytest.raises(Unavailable, match="cuda"):
        ceilings.kvikio_bulk(items, opts, "volumes")


def test_ratios_pick_the_ceiling_of_the_mode_and_data() -> None:
    results = [
        Result("O_DIRECT x16, a request a tensor", "volumes", 10, 1.0, 100, "ceiling"),
        Result("ceiling np.fromfile (warm)", "volumes", 10, 0.1, 100, "ceiling"),
        Result(report.PERSISTENT, "volumes", 10, 4.0, 100),
        Result("ours", "volumes", 10, 2.0, 100, "ours"),
        Result("dali readers.file", "images", 10, 1.0, 5, "research"),
    ]
    cold = {r["name"]: r for r in report.ratios(results, cold=True)}
    other = {r["name"]: r for r in report.ratios(results, cold=True, peers={"volumes": "ours"})}
    assert other[report.PERSISTENT]["x_peer"] == pytest.approx(0.5) and other["ours"]["peer"] == "ours"
    warm = {r["name"]: r for r in report.ratios(results, cold=False)}
    assert cold["ours"]["x_ceiling"] == pytest.approx(0.5) and warm["ours"]["x_ceiling"] == pytest.approx(0.05)
    assert cold["ours"]["x_peer"] == pytest.approx(2.0)
    assert cold["dali readers.file"]["x_ceiling"] is None and cold["dali readers.file"]["x_peer"] is None
    text = report.table(report.ratios(results, cold=True), [("xnvme-bam", "no GPU")])
    assert text.splitlines()[-1] == "unavailable here: xnvme-bam"


def test_helpers(tmp_path: Path) -> None:
    import torch

    batch = {"image": torch.zeros(2, 3, dtype=torch.float32), "_items": torch.arange(2), "x": [np.zeros(4, np.uint8)]}
    assert nbytes_of(batch) == 2 * 3 * 4 + 4
    tensors = pytest.importorskip("nvidia.dali.tensors")  # a TensorList: from its shapes and dtype, no copy
    ragged = tensors.TensorListCPU([np.zeros((3, 4), np.float32), np.zeros((5, 2), np.float32)])
    assert nbytes_of([ragged]) == (12 + 10) * 4
    assert cycle(3, 7) == [0, 1, 2, 0, 1, 2, 0]
    with pytest.raises(Unavailable):
        cycle(0, 1)
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 8192)
    assert evict([f, tmp_path / "missing"], drop_caches=False) == "fadvise(1 files)"  # 16 KiB touched: under 1 MiB
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * (3 << 20))
    assert evict([big], drop_caches=False) == "fadvise(1 files)+6 MiB touched"


def test_touch_memory_faults_in_and_frees_what_it_is_asked_for() -> None:
    """Fresh pages are faulted in (the process's page faults grow) and given back."""
    import resource

    from workflows.bench.core import touch_memory

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    assert touch_memory((8 << 20) + 100) == 8 << 20  # whole pages only
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before >= 4  # 8 MiB: 2,048 pages, 4 huge ones
    assert touch_memory(0) == 0


def _dirty_pages(path: Path) -> int | None:
    """Dirty pages of the file by cachestat(2) (None: no cachestat here)."""
    from loaders.backends.base import PageCacheProbe

    fd = os.open(path, os.O_RDONLY)
    try:
        st = PageCacheProbe().counts(fd, 0, path.stat().st_size)
    finally:
        os.close(fd)
    return None if st is None else int(st.dirty)


def test_a_timed_pass_starts_with_nothing_dirty(tmp_path: Path) -> None:
    """`start_pass` writes out what earlier reads and writes left dirty (a relatime atime, a journal) before a
    warm pass is timed, and evicts for a cold one."""
    f = tmp_path / "f.bin"
    f.write_bytes(b"x" * 65536)
    dirty = _dirty_pages(f)
    if not dirty:
        pytest.skip("no dirty page to see: no cachestat(2) here, or the file was already written back")
    assert start_pass([f], cold=False) == "warm"
    assert _dirty_pages(f) == 0
    assert start_pass([f], cold=True).startswith("fadvise(1 files)")


@pytest.mark.loopdev
def test_raw_block_ways_on_a_loop_mounted_filesystem(
    make_loopfs: Any, nifti_dataset: Path, image_tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On ext4 through a loop device, the blockdev ways read the same bytes raw that the others read."""
    import shutil

    from prep.cache import prepare_cache
    from prep.mapping import build_bmap
    from workflows.bench import ours, research

    fs = make_loopfs("ext4", size_mb=96)
    tree = fs.mountpoint / "train"
    shutil.copytree(image_tree, tree)
    build_bmap(fs.mountpoint, fs.mountpoint / "bmap.json")
    prepare_cache(nifti_dataset, PIPELINE, fs.mountpoint / "cache", workers=1, processes=False, shard_size=8 << 20)
    opts = Options(batchsize=5, batches=3, cold=True)
    raw = research.blockprep_dali(opts, tree, fs.mountpoint / "bmap.json", "blockdev")
    files = research.blockprep_dali(opts, tree, backend="posix")
    assert raw.nbytes == files.nbytes == 15 * 32 * 32 * 3 and raw.kind == "ours"
    if not (fs.mountpoint / "cache" / "bmap.json").is_file():
        pytest.skip("prep cache wrote no shard bmap here")
    cache = fs.mountpoint / "cache"
    blockdev = ours.prepared(cache, "blockdev", opts, **ours.backend_options("blockdev", cache / "bmap.json"))
    posix = ours.prepared(cache, "posix", opts)
    assert blockdev.name == "blockprep prepared (blockdev)" and blockdev.nbytes == posix.nbytes > 0


def test_without_dali_the_dali_ways_say_so(
    monkeypatch: pytest.MonkeyPatch, image_tree: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    status = benchmark.main(["dali", "--datadir", str(image_tree), "--batches", "1", "--warm", "--out", str(tmp_path)])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  unavailable: dali:")]
    assert status == 1 and len(lines) == 1 and "blockprep[dali]" in lines[0]


def test_all_on_partial_data_measures_what_is_there(
    tmp_path: Path, image_tree: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "data" / "images").mkdir(parents=True)
    (tmp_path / "data" / "images" / "train").symlink_to(image_tree)
    status = benchmark.main(["all", "--data", str(tmp_path / "data"), "--batches", "1", "--batchsize", "2", "--warm",
                             "--out", str(tmp_path / "out")])  # fmt: skip
    text = capsys.readouterr().out
    assert status == 0, text
    assert "unavailable: persistent: " in text and "datalist not found" in text
    assert "unavailable: dali-numpy: " in text and "unavailable: prepared --backend posix: " in text
    assert {r["data"] for r in _rows(tmp_path / "out").values()} == {"images"}


@pytest.mark.parametrize("line", SEED_LINES)
@pytest.mark.parametrize("order", ["before", "after"])
def test_research_command_lines_parse(
    line: str, order: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Global options before the subcommand (the seed's order) or after it (blockprep's) parse alike."""
    argv = line.split()
    if order == "after":
        argv = argv[4:5] + argv[:4] + argv[5:]
    monkeypatch.chdir(tmp_path)  # no /data, no bmap here: each way says why in one line (exit 1, not 2)
    status = benchmark.main(argv)
    text = capsys.readouterr().out
    way = line.split()[4]
    assert status == 1, text
    assert f"benchmark {way}: cold, 1000 batches of 64, device cpu" in text
    assert len([x for x in text.splitlines() if x.startswith(f"  unavailable: {way}:")]) == 1, text


def test_global_options_are_hoisted_in_front_of_the_subcommand() -> None:
    hoist = benchmark.hoist_global_options
    cmds = {"dali", "all"}
    assert hoist(["dali", "--datadir", "d", "--batchsize=8", "--warm", "--out", "o"], cmds) == [
        "--batchsize=8", "--warm", "--out", "o", "dali", "--datadir", "d"]  # fmt: skip
    assert hoist(["--batches", "2", "all", "--data", "x"], cmds) == ["--batches", "2", "all", "--data", "x"]
    assert hoist(["--help"], cmds) == ["--help"]


def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert benchmark.main(["dali"]) == 2  # --datadir missing
    assert benchmark.main(["--batchsize", "0", "dali", "--datadir", "x"]) == 2
    assert benchmark.main(["no-such-way"]) == 2
    assert "--datadir" in capsys.readouterr().err


def test_a_cuda_mps_daemons_pipe_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Figures taken under CUDA MPS say so: the pipe folder `CUDA_MPS_PIPE_DIRECTORY` names counts once its
    daemon's control pipe is there (a FIFO, as nvidia-cuda-mps-control makes it)."""
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert benchmark.mps_pipe() is None
    os.mkfifo(tmp_path / "control")
    assert benchmark.mps_pipe() == tmp_path
