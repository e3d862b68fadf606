"""The training benchmark runs end to end on CPU with tiny volumes and a tiny UNet (it cannot rot)."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from workflows import benchmark

TINY = ["--size", "24", "--crop", "16", "--batchsize", "2", "--count", "4", "--epochs", "2", "--workers", "1",
        "--device", "cpu", "--channels", "4,8"]  # fmt: skip


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("train_bench")


def test_train_rows_table_and_files(out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows_wanted = "persistent,drop-in,transport,transport-tail,transport-peer,transport-tail-meta,fast,fast-half"
    status = benchmark.main(["train", *TINY, "--rows", rows_wanted, "--out", str(out)])
    printed = capsys.readouterr().out
    assert status == 0, printed
    rows = _rows(out / "bench.csv")
    names = [r["name"] for r in rows]
    assert names[0].startswith("compute only") and len(rows) == 9, names
    for r in rows:
        assert int(r["items"]) == 2 and float(r["items_per_s"]) > 0 and r["data"] == "train"
    assert float(rows[0]["x_ceiling"]) == pytest.approx(1.0)
    persistent = next(r for r in rows if r["name"].startswith("monai PersistentDataset"))
    assert float(persistent["x_peer"]) == pytest.approx(1.0)
    transport = [r for r in rows if r["name"].startswith("DataLoader(")]  # the DataLoader's own ceilings
    assert [r["kind"] for r in transport] == ["reference"] * 4 and "x best MONAI" not in transport[0]["note"]
    assert "the tail after the crop" in transport[1]["name"] and "PersistentDataset's own" in transport[2]["name"]
    assert "MONAI's own crops (MetaTensors)" in transport[3]["name"]
    doc = json.loads((out / "bench.json").read_text())
    for r in doc["results"]:
        assert 0 <= r["extra"]["waiting %"] < 100
        # this process's threads over the timed steps' spans: at most its cores (+1 for the jitter of CPU-time
        # accounting over the few milliseconds of a tiny run), never the DataLoader workers' CPU too
        assert 0 < r["extra"]["process CPU % of a core"] < 100 * ((os.cpu_count() or 1) + 1)
    assert (out / "bench.png").stat().st_size > 0
    assert "x ceiling" in printed and "blockprep PreparedLoader" in printed and "waiting %" in printed


def test_gpu_rows_say_why_they_cannot_run_on_cpu(out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert benchmark.main(["train", *TINY, "--rows", "cache-gpu,gds,fast", "--out", str(out / "g")]) == 0
    doc = json.loads((out / "g" / "bench.json").read_text())
    assert set(doc["unavailable"]) == {"cache-gpu", "gds"}
    assert all("CUDA" in why for why in doc["unavailable"].values())


def test_fast_path_variant_rows_pass_their_options(out: Path) -> None:
    rows = "fast@tail_thread=False,fast-half@copy_threads=1;prefetch=3"
    assert benchmark.main(["train", *TINY, "--rows", rows, "--out", str(out / "v")]) == 0
    names = [r["name"] for r in _rows(out / "v" / "bench.csv")]
    assert any(n.endswith("crop read, tail_thread=False") for n in names), names
    assert any(n.endswith("half the dataset, copy_threads=1;prefetch=3") for n in names), names


def test_rounds_interleave_every_row_and_keep_each_rounds_ratios(out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--rounds N: every row N times, interleaved (the ceiling first and last in each round, one row kept); a
    row is its median round and carries the median of its per-round ratios to the ceiling and to
    PersistentDataset."""
    args = ["train", *TINY, "--rows", "persistent,fast", "--rounds", "3", "--out", str(out / "r")]
    assert benchmark.main(args) == 0
    printed = capsys.readouterr().out
    assert all(f"round {k}/3" in printed for k in (1, 2, 3)), printed
    doc = json.loads((out / "r" / "bench.json").read_text())
    rows = {r["name"]: r for r in doc["results"]}
    assert len(doc["results"]) == len(rows) == 3  # the ceiling's second run of each round is merged, not a row
    for name, row in rows.items():
        extra = row["extra"]
        assert extra["rounds"] == 3 and extra["min"] <= row["items_per_s"] <= extra["max"]
        if name.startswith("compute only"):
            assert "each round" in row["note"] and "x ceiling per round" not in extra
            assert float(extra["x peer per round"]) > 0
        elif name.startswith("monai PersistentDataset"):
            assert "x peer per round" not in extra and float(extra["x ceiling per round"]) > 0
        else:
            assert float(extra["x peer per round"]) > 0 and float(extra["x ceiling per round"]) > 0


def test_min_seconds_adds_epochs_until_the_timed_steps_add_up(out: Path) -> None:
    """--min-seconds S: epochs past --epochs until the timed steps add up to S (a GPU's default is 3 s: a
    spheres epoch on an H100 is 0.06 s); CPU keeps --epochs."""
    from workflows.bench.train import MIN_SECONDS_GPU, _min_seconds

    assert _min_seconds(None, "cpu") == 0 and _min_seconds(None, "cuda:0") == MIN_SECONDS_GPU
    assert _min_seconds(0.5, "cuda:0") == 0.5
    args = ["train", *TINY, "--rows", "fast", "--out", str(out / "m")]
    assert benchmark.main(args) == 0
    plain = {r["name"]: int(r["items"]) for r in _rows(out / "m" / "bench.csv")}
    assert set(plain.values()) == {2}  # one timed epoch of 2 steps
    assert benchmark.main([*args, "--min-seconds", "0.5"]) == 0
    for r in _rows(out / "m" / "bench.csv"):
        assert float(r["seconds"]) >= 0.5 and int(r["items"]) > 2 and int(r["items"]) % 2 == 0, r


def test_min_seconds_stops_on_a_source_with_no_batches() -> None:
    """Epochs with no steps never add up to --min-seconds: the row stops and says so instead of looping."""
    from workflows.bench.core import Unavailable
    from workflows.bench.train_loop import TrainOptions, time_loop

    opts = TrainOptions(size=24, crop=16, batch=2, epochs=2, device="cpu", channels=(4, 8), min_seconds=60.0)
    with pytest.raises(Unavailable, match="no timed steps"):
        time_loop("empty", "ours", lambda epoch: [], opts)


def test_bad_options_exit_2() -> None:
    assert benchmark.main(["train", "--epochs", "1"]) == 2
    assert benchmark.main(["train", "--crop", "64", "--size", "32"]) == 2


def _ddp_row(out: Path, world: int, *args: str) -> dict[str, object]:
    """The --ddp row under torchrun with `world` ranks: it exits 0 and writes its two rows; its ddp.json."""
    env = {**os.environ, "PYTHONPATH": str(Path(benchmark.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world), "-m",
           "workflows.benchmark", "train", "--ddp", *TINY, *args, "--out", str(out / "ddp")]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _rows(out / "ddp" / "bench.csv")
    names = ["compute only, 1 GPU", "blockprep PreparedLoader, 1 GPU", f"compute only, DDP x{world}",
             f"blockprep PreparedLoader, DDP x{world}"]  # fmt: skip
    assert [r["name"] for r in rows] == names
    assert [r["data"] for r in rows] == ["1 GPU", "1 GPU", f"DDP x{world}", f"DDP x{world}"]
    assert all(float(r["x_ceiling"]) > 0 for r in rows)  # each pair against its own ceiling
    got: dict[str, object] = json.loads((out / "ddp" / "ddp.json").read_text())
    assert float(got["ceilings_x_one_gpu"]) > 0  # type: ignore[arg-type]
    return got


@pytest.mark.slow  # two torchrun processes with gloo: ~20 s on the 2-core box
def test_ddp_row_on_cpu_with_gloo(out: Path) -> None:
    got = _ddp_row(out, 2, "--count", "5", "--epochs", "3")
    assert got["every_item_once"] is True and got["world"] == 2 and got["x_one_gpu"] > 0


@pytest.mark.gpu
def test_ddp_row_on_every_gpu_with_the_defaults(out: Path) -> None:
    """One rank per GPU of the box (2, 4, ...) under torchrun with NCCL, the loader's defaults (its feeder)
    on each rank's cuda:LOCAL_RANK: the row finishes and every item is trained once per epoch."""
    import torch

    world = torch.cuda.device_count()
    if world < 2:
        pytest.skip("needs two CUDA GPUs")
    got = _ddp_row(out, world, "--device", "cuda", "--count", str(2 * world + 1), "--epochs", "3")
    assert got["every_item_once"] is True and got["world"] == world and got["x_one_gpu"] > 0


WORKLOAD_TINY = {
    "seg-ct": ["--size", "40", "--crop", "16", "--count", "4"],
    "seg-multiclass": ["--size", "40", "--crop", "32", "--count", "4"],
    "brats": ["--size", "24", "--crop", "16", "--count", "4"],
    "gds-seed": ["--size", "24", "--crop", "16", "--count", "3"],
    "mednist": ["--size", "32", "--count", "16", "--batchsize", "8"],
    "slices": ["--size", "40", "--crop", "24", "--count", "4", "--batchsize", "2"],
    "seg-aug": ["--size", "40", "--crop", "16", "--count", "4"],
    "seg-elastic": ["--size", "40", "--crop", "16", "--count", "4"],
}


@pytest.mark.parametrize(
    "workload",
    ["seg-ct", pytest.param("seg-multiclass", marks=pytest.mark.slow), pytest.param("brats", marks=pytest.mark.slow),
     pytest.param("gds-seed", marks=pytest.mark.slow),
     pytest.param("mednist", marks=pytest.mark.slow), "slices", pytest.param("seg-aug", marks=pytest.mark.slow),
     pytest.param("seg-elastic", marks=pytest.mark.slow)],
)  # fmt: skip
def test_tutorial_workloads_run_every_loader(workload: str, out: Path) -> None:
    """Each tutorial workload trains end to end on CPU through MONAI's way, the drop-in and PreparedLoader."""
    args = ["train", "--workload", workload, *WORKLOAD_TINY[workload], "--epochs", "2", "--workers", "1",
            "--device", "cpu", "--rows", "persistent,drop-in,fast", "--out", str(out / workload)]  # fmt: skip
    assert benchmark.main(args) == 0
    rows = _rows(out / workload / "bench.csv")
    assert {r["data"] for r in rows} == {workload}
    names = [r["name"] for r in rows]
    assert any(n.startswith("blockprep PreparedLoader") for n in names), names
    assert any(n.startswith("blockprep PreparedPersistentDataset") for n in names), names
    assert any(n.startswith("monai PersistentDataset") for n in names), names
    assert all(float(r["items_per_s"]) > 0 for r in rows)


def test_serving_row_times_the_feeders_batches(out: Path) -> None:
    """fast-serving: the defaults with the feeder forced on the CPU (auto keeps the batches in process there),
    timed once its child serves: the row runs and says so in its name."""
    rows = "fast-serving@feeder=True"
    assert benchmark.main(["train", *TINY, "--rows", rows, "--out", str(out / "s")]) == 0
    names = [r["name"] for r in _rows(out / "s" / "bench.csv")]
    assert any("timed once the feeder serves" in n for n in names), names


def _evict_counts(folder: Path) -> str:
    """'' where a file written under `folder`, evicted and read back, counts bytes read here; else why not."""
    from workflows.bench.core import Unavailable, evict
    from workflows.bench.train_cold import read_counters

    probe = folder / "probe.bin"
    probe.write_bytes(os.urandom(1 << 20))
    try:
        counters = read_counters(probe, os.getpid())
    except Unavailable as exc:
        return str(exc)
    evict([probe])
    before = [c.read() for c in counters]
    probe.read_bytes()
    if any(c.read() == b for c, b in zip(counters, before)):
        return f"{folder}: a file evicted and read back counts no bytes read here ({counters[0].how})"
    return ""


def test_cold_epochs_note_bytes_read_against_the_crops(out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--cold-epochs: every row but the ceiling notes MB read per timed epoch (and what counted them), the crops'
    MB and the ratio; the disk's O_DIRECT rate is printed with the table. Nothing timed is asserted."""
    args = ["train", *TINY, "--rows", "persistent,fast,fast-bricks", "--cold-epochs", "--out", str(out / "c")]
    status = benchmark.main(args)
    printed = capsys.readouterr().out
    assert status == 0, printed
    assert "disk read rate" in printed and "read MB/epoch" in printed, printed
    doc = json.loads((out / "c" / "bench.json").read_text())
    rows = [r for r in doc["results"] if r["kind"] != "ceiling"]
    assert any("bricks written in" in r["name"] for r in rows), [r["name"] for r in rows]
    assert list(out.glob("c/work/*/cache/manifest.json"))
    assert not list(out.glob("c/work/*/cache/bricks")), "the bricks row removes the bricks it wrote"
    assert len(rows) == 3 and all("read MB/epoch" not in r["extra"] for r in doc["results"] if r not in rows)
    for r in rows:
        extra = r["extra"]
        assert extra["read MB/epoch"] >= 0 and extra["read/crops"] >= 0 and extra["read counted by"], extra
        assert extra["crops MB/epoch"] == pytest.approx(2 * 2 * 16**3 * 4 * 2 / 1e6, rel=0.5), extra  # 2 steps
    assert any(line.startswith("disk read rate") for line in doc["footer"]), doc["footer"]
    why = _evict_counts(out)
    if why:
        pytest.skip(why)
    assert all(r["extra"]["read MB/epoch"] > 0 for r in rows), rows


def test_a_cold_rows_first_batch_leaves_out_the_benchmarks_own_eviction(
    out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each cold epoch starts with the workload's files evicted (sync, fadvise, memory touched: tens of seconds
    on a GPU box); the first batch's seconds are the row's (its loader built, its first batch made), not that.
    Here every eviction moves the clock on by 1,000 s: a first batch counted with it would show them."""
    import time

    import workflows.bench.train_cold as train_cold

    real_clock, real_evict = time.perf_counter, train_cold.evict
    skipped = [0.0]

    def evict(*args: Any, **kwargs: Any) -> str:
        skipped[0] += 1000.0
        return real_evict(*args, **kwargs)

    monkeypatch.setattr(time, "perf_counter", lambda: real_clock() + skipped[0])
    monkeypatch.setattr(train_cold, "evict", evict)
    args = ["train", *TINY, "--rows", "persistent,fast", "--cold-epochs", "--out", str(out / "c")]
    assert benchmark.main(args) == 0
    doc = json.loads((out / "c" / "bench.json").read_text())
    firsts = [r["extra"]["first batch s"] for r in doc["results"] if r["kind"] != "ceiling"]
    assert len(firsts) == 2 and all(0 <= f < 1000 for f in firsts), firsts
    assert skipped[0] >= 4000  # two rows, two epochs each, every epoch evicted first


def test_crop_bytes_per_step_counts_each_keys_voxels_at_the_caches_dtype() -> None:
    from workflows.bench.train_cold import crop_bytes_per_step

    batch = {"image": ((2, 4, 8, 8, 8), "float"), "label": ((2, 1, 8, 8, 8), "binary"), "meta": ((2,), "class")}
    assert crop_bytes_per_step(batch, {"image": "float32", "label": "uint8"}) == 2 * 512 * (4 * 4 + 1)


def test_proc_counter_counts_a_childs_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the data lies on no block device in /sys, the bytes read are /proc io's over the benchmark's
    process tree: a child's reads count, also once it has exited (the kernel folds them into its parent)."""
    from workflows.bench import train_cold
    from workflows.bench.core import evict

    monkeypatch.setattr(train_cold, "block_stat", lambda path: None)
    probe = tmp_path / "probe.bin"
    probe.write_bytes(os.urandom(1 << 20))
    (counter,) = train_cold.read_counters(probe, os.getpid())
    assert counter.how.startswith("/proc io")
    if why := _evict_counts(tmp_path):
        pytest.skip(why)
    evict([probe])
    before = counter.read()
    subprocess.run(["cat", str(probe)], check=True, stdout=subprocess.DEVNULL)
    assert counter.read() - before >= 1 << 20


class _Trial:
    """What the settled row reads of a loader: its feeder's verdict and process (and waits for it to be ready)."""

    def __init__(self, verdict: str | None, pid: int | None) -> None:
        self.feeder_verdict, self.feeder_pid = verdict, pid
        self.waited = 0

    def wait_feeder(self) -> None:
        self.waited += 1


def test_settled_row_times_the_choice_once_it_is_warm() -> None:
    """fast-settled: a loader with no feeder is settled at once; one the child keeps, once decided; one whose
    batches came back, or whose child the trial started again, from the second epoch after (the first is a
    warm-up)."""
    from workflows.bench.train_rows import _chosen

    assert _chosen(_Trial(None, None))()
    starting = _Trial(None, 123)
    chosen = _chosen(starting)
    assert not chosen()
    starting.feeder_verdict = "feeder kept: 30.0 ms a step fed, 31.0 ms made here"
    assert starting.waited == 0
    assert chosen() and chosen()
    assert starting.waited == 2  # a child started again by the trial is ready before a timed epoch
    starting.feeder_pid = 456  # the trial's host feeder lost: the first kind of child started again
    assert [chosen(), chosen()] == [False, True]  # its first epoch fills its tier: untimed
    back = _Trial("batches made in this process again: 59.0 ms a step fed, 56.9 ms made here", None)
    chosen = _chosen(back)
    assert [chosen(), chosen(), chosen()] == [False, True, True]


@pytest.mark.parametrize("name", ["TAIL_GRAPHS", "PACK_AHEAD", "TAIL_REPLAY"])
def test_a_row_may_set_how_the_feeder_launches_and_hands_over(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """fast-settled@tail_graphs=False, @pack_ahead=False: the tunable and the variable the feeder's process reads
    set for the row only, then put back."""
    from loaders import tunables
    from workflows.bench.train_rows import _tunable

    var = f"BLOCKPREP_{name}"
    monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(tunables, name, "feeder")
    with _tunable(name, False):
        assert getattr(tunables, name) is False and os.environ[var] == "0"
    assert getattr(tunables, name) == "feeder" and var not in os.environ
    with _tunable(name, True):
        assert getattr(tunables, name) is True and os.environ[var] == "1"
    with _tunable(name, None):
        assert getattr(tunables, name) == "feeder" and var not in os.environ


def test_a_row_may_set_a_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """...;tail_patterns=6: a count, for the row only, in the variable too."""
    from loaders import tunables
    from workflows.bench.train_rows import _tunable

    monkeypatch.delenv("BLOCKPREP_TAIL_PATTERNS", raising=False)
    monkeypatch.setattr(tunables, "TAIL_PATTERNS", 0)
    with _tunable("TAIL_PATTERNS", 6):
        assert tunables.TAIL_PATTERNS == 6 and os.environ["BLOCKPREP_TAIL_PATTERNS"] == "6"
    assert tunables.TAIL_PATTERNS == 0 and "BLOCKPREP_TAIL_PATTERNS" not in os.environ


def test_a_row_may_leave_out_the_augmentations() -> None:
    """fast@augment=False: the chain up to its crop and the deterministic transforms after it (the squeeze a 2D
    model needs); every random one after the crop left out."""
    import monai.transforms as mt

    from workflows.bench.core import Unavailable
    from workflows.bench.train_rows import unaugmented

    k = ["image", "label"]
    head = [mt.ScaleIntensityd(keys="image"), mt.RandSpatialCropSamplesd(k, roi_size=(8, 8, 1), num_samples=2)]
    after = [mt.SqueezeDimd(k, dim=-1), mt.RandFlipd(k, prob=0.5), mt.EnsureTyped(k), mt.RandRotate90d(k, prob=0.5)]
    kept = unaugmented(mt.Compose([*head, *after], map_items=True)).transforms
    assert [type(t).__name__ for t in kept] == [
        "ScaleIntensityd", "RandSpatialCropSamplesd", "SqueezeDimd", "EnsureTyped"
    ]  # fmt: skip
    with pytest.raises(Unavailable, match="no crop"):
        unaugmented(mt.Compose(after))


def test_slices_train_without_their_augmentations(out: Path) -> None:
    args = ["train", "--workload", "slices", *WORKLOAD_TINY["slices"], "--epochs", "2", "--workers", "1",
            "--device", "cpu", "--rows", "fast@augment=False", "--out", str(out / "unaugmented")]  # fmt: skip
    assert benchmark.main(args) == 0
    names = [r["name"] for r in _rows(out / "unaugmented" / "bench.csv")]
    assert any(n.endswith("augment=False") for n in names), names


def test_a_row_may_have_a_host_feeder_tried(monkeypatch: pytest.MonkeyPatch) -> None:
    """...@host_feed='auto': feeder="auto" tries a host feeder after the first child, in the child's variable too
    (`loaders.tunables.HOST_FEED`, which reads "auto" from the environment as the row sets it)."""
    import importlib

    from loaders import tunables
    from workflows.bench.train_rows import _tunable

    monkeypatch.delenv("BLOCKPREP_HOST_FEED", raising=False)
    monkeypatch.setattr(tunables, "HOST_FEED", False)
    with _tunable("HOST_FEED", "auto"):
        assert tunables.HOST_FEED == "auto" and os.environ["BLOCKPREP_HOST_FEED"] == "auto"
        assert importlib.reload(tunables).HOST_FEED == "auto"
    assert "BLOCKPREP_HOST_FEED" not in os.environ
    assert importlib.reload(tunables).HOST_FEED == "chosen"
    with _tunable("HOST_TAKE_MARGIN", 2):  # ...;host_take_margin=2: milliseconds, a float as the variable gives
        assert tunables.HOST_TAKE_MARGIN == 2.0 and os.environ["BLOCKPREP_HOST_TAKE_MARGIN"] == "2.0"
        assert importlib.reload(tunables).HOST_TAKE_MARGIN == 2.0
