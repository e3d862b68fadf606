"""The research code's six benchmark command lines (seed 004's README), run verbatim through
`python -m workflows.benchmark` against demo-like data: the ways that can run here measure, the others
say why in one line and exit 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from seedlines import SEED_LINES

from loaders.faces.dali import list_labeled_files

pytest.importorskip("nvidia.dali")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def research_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """/data as the research code expects it: data/train/<class>/*.JPEG (an empty class folder and a stray
    text file too, which readers.file skips), its flat map, and a stand-in for /dev/libnvm0."""
    from prep.synth import image_tree

    base = tmp_path_factory.mktemp("research")
    train = image_tree(base / "data", classes=3, per_class=4, size=32, seed=5)
    (train / "0empty").mkdir()
    classes = sorted(p.name for p in train.iterdir() if p.is_dir())
    (train / classes[1] / "notes.txt").write_text("not an image")
    flat = {
        f"train/{p}": {"startblock": 8 * i, "endblock": 8 * i + 7} for i, (p, _) in enumerate(list_labeled_files(train))
    }
    (base / "imagenet_train_bmap.json").write_text(json.dumps(flat))
    (base / "libnvm0").write_bytes(bytes(1 << 20))
    return base


def _run(line: str, base: Path) -> tuple[int, str]:
    args = line.replace("64", "4").replace("1000", "2").split()
    args = [str(base / "data") if a == "/data" else str(base / "libnvm0") if a == "/dev/libnvm0" else a for a in args]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "workflows.benchmark", *args], cwd=base, env=env, capture_output=True, text=True
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("line", SEED_LINES, ids=[" ".join(x.split()[4:6]) for x in SEED_LINES])
def test_seed_command_lines_run_verbatim(line: str, research_data: Path) -> None:
    status, out = _run(line, research_data)
    way = line.split()[4]
    unavailable = [x for x in out.splitlines() if x.startswith(f"  unavailable: {way}:")]
    assert "Traceback" not in out, out
    if way in ("dali", "python-file"):  # these run here: the tree under --datadir/train, images decoded
        assert status == 0 and not unavailable, out
        n = len(list_labeled_files(research_data / "data" / "train"))
        assert n == 12 and "images" in out
        return
    assert status == 1 and len(unavailable) == 1, out  # cannot run here: one line saying why
    why = unavailable[0]
    if "--mem gpu" in line or way == "xnvme-bam":
        assert "GPU" in why, why
    else:
        assert "xnvme" in why and ("libxnvme" in why or "blockprep[xnvme]" in why), why


def test_datadir_is_the_folder_holding_train(research_data: Path) -> None:
    status, out = _run("--batchsize 64 --batches 1000 dali --datadir /data/train", research_data)
    assert status == 1 and "no train/ folder" in out and "folder holding train/" in out, out


def test_dali_readers_on_a_folder_without_train_says_so_in_one_line(research_data: Path) -> None:
    """A scenario whose own data is unusable: one line naming the folder and the fix, exit 2, no traceback."""
    status, out = _run("--batchsize 64 --batches 1000 dali-readers --datadir /data/train", research_data)
    assert status == 2 and "Traceback" not in out, out
    assert [x for x in out.splitlines() if "no train/ folder" in x and "--datadir is the folder holding" in x], out


def test_dali_readers_smoke(research_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from workflows import benchmark

    argv = ["--batchsize", "4", "--batches", "2", "--warm", "--out", str(tmp_path), "dali-readers"]
    status = benchmark.main([*argv, "--datadir", str(research_data / "data")])
    out = capsys.readouterr().out
    assert status == 0, out
    for row in (
        "ceiling DALI, one batch held",
        "dali readers.file",
        "research Python iterator",
        "blockprep FileSource",
    ):
        assert f"  {row}: " in out, out
    rows = json.loads((tmp_path / "bench.json").read_text())
    assert {r["name"] for r in rows["results"]} >= {"blockprep FileSource", "dali readers.file"}
    held = next(r for r in rows["results"] if r["name"] == "ceiling DALI, one batch held")
    assert held["kind"] == "ceiling" and held["items"] == 8 and held["nbytes"] > 0  # 2 batches of 4 delivered


def test_dali_readers_rounds_give_one_median_row_per_way(research_data: Path, tmp_path: Path) -> None:
    """--rounds N: every way runs N times, interleaved; one row each (the median round), with the rounds'
    range and the median of the per-round ratios to readers.file."""
    from workflows import benchmark

    argv = ["--batchsize", "4", "--batches", "2", "--warm", "--out", str(tmp_path), "dali-readers", "--rounds", "3"]
    assert benchmark.main([*argv, "--datadir", str(research_data / "data")]) == 0
    rows = {r["name"]: r for r in json.loads((tmp_path / "bench.json").read_text())["results"]}
    ways = ("dali readers.file", "research Python iterator", "blockprep FileSource")
    for name in ways:
        row = rows[name]
        assert row["extra"]["rounds"] == 3 and row["extra"]["min"] <= row["items_per_s"] <= row["extra"]["max"]
    assert "x peer per round" not in rows["dali readers.file"]["extra"]
    assert float(rows["blockprep FileSource"]["extra"]["x peer per round"]) > 0
    # the labels each way delivered in its timed pass, against readers.file's
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert [rows[n]["extra"]["labels"] for n in ways[1:]] == ["= peer", "= peer"]
    assert "labels: every way = dali readers.file" in doc["footer"]
    assert rows["dali readers.file"]["x_peer"] == 1.0


def test_labels_that_differ_from_readers_file_are_named() -> None:
    from workflows.bench.core import Result, Rows
    from workflows.bench.research import labels_digest
    from workflows.bench.research_readers import same_labels

    rows = Rows()
    for name, labels in (("dali readers.file", [0, 0, 1]), ("a", [0, 0, 1]), ("b", [0, 1, 0])):
        rows.results.append(Result(name, "images", 3, 1.0, 3, extra={"labels": labels_digest(np.array(labels))}))
    same_labels(rows, "dali readers.file")
    assert [r.extra.get("labels") for r in rows.results] == [None, "= peer", "DIFFER"]
    assert rows.footer == ["labels: DIFFER in b"]


def test_a_rows_round_is_its_median_rate_not_its_median_time() -> None:
    """Rounds that time more epochs take longer at a higher rate: the row kept is the round of median items/s."""
    from workflows.bench.core import Result, Rows

    rounds = iter([(100, 1.0), (600, 3.0), (500, 10.0)])  # 100, 200 and 50 items/s; the median time is 200's
    rows = Rows()
    rows.add_rounds([("ours", lambda: Result("ours", "images", *next(rounds), 1000))], 3)
    (row,) = rows.results
    assert row.items_per_s == 100 and (row.extra["min"], row.extra["max"]) == (50, 200)


def test_short_rounds_earn_a_footer_and_long_ones_none() -> None:
    """Ratios of rounds shorter than SHORT_ROUND_S (the peer's median) do not hold between runs: the table
    says so under it; rounds as long or longer say nothing."""
    from workflows.bench.core import SHORT_ROUND_S, Result, Rows

    for seconds, said in ((SHORT_ROUND_S / 4, True), (SHORT_ROUND_S * 2, False)):
        rows = Rows()
        jobs = [(n, lambda n=n, s=seconds: Result(n, "images", 100, s, 1000)) for n in ("peer", "ours")]
        rows.add_rounds(jobs, 3, peer="peer")
        lines = [x for x in rows.footer if x.startswith("rounds: peer's took")]
        assert len(lines) == (1 if said else 0), rows.footer
        if said:
            assert f"{seconds:.2f} s (median)" in lines[0] and "--batches" in lines[0]
    one = Rows()
    one.add_rounds([("peer", lambda: Result("peer", "images", 100, 0.01, 1000))], 1, peer="peer")
    assert one.footer == []  # one round: no ratios between rounds to speak of
