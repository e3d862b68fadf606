"""The training examples run a few CPU steps on tiny data and report how long they waited for data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from workflows import train_classify2d, train_seg3d

PIPELINE = Path(train_seg3d.__file__).parent / "pipelines" / "spheres.py"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three 48^3 volumes (the pipeline's 32^3 crops need >= 32 voxels after resampling to 1 mm)."""
    from prep.cache import prepare_cache
    from prep.synth import nifti_dataset

    root = tmp_path_factory.mktemp("seg")
    datalist = nifti_dataset(root / "nifti", count=3, size=48, seed=1)
    prepare_cache(datalist, PIPELINE, root / "cache", workers=1, processes=False)
    return root / "cache"


@pytest.mark.slow  # ~12 s: a cache, three loaders, a UNet
def test_seg3d_fast_drop_in_and_persistent_train_on_the_same_data(cache: Path, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    reports = train_seg3d.main(["--cache", str(cache), "--loader", "all", "--iters", "2", "--batchsize", "1",
                                "--workers", "0", "--channels", "4,8", "--persistent-dir", str(tmp_path / "pt"),
                                "--json", str(report)])  # fmt: skip
    fast, drop_in, persistent = reports
    assert (fast.loader, drop_in.loader, persistent.loader) == ("fast", "drop-in", "persistent")
    for r in reports:
        assert r.iters == 2 and 0 < r.wait_seconds < r.seconds and 0 < r.wait_share < 1
        assert math.isfinite(r.first_loss) and math.isfinite(r.last_loss)
    # same seed, same crops, same weights: the cache delivers what PersistentDataset delivers
    assert drop_in.first_loss == pytest.approx(persistent.first_loss, rel=1e-4)
    assert any((tmp_path / "pt").iterdir())
    assert [d["loader"] for d in json.loads(report.read_text())] == ["fast", "drop-in", "persistent"]


def test_seg3d_fast_path_with_a_device_tier(cache: Path) -> None:
    (r,) = train_seg3d.main(["--cache", str(cache), "--iters", "3", "--batchsize", "2", "--channels", "4,8",
                             "--gpu-budget", "1GiB"])  # fmt: skip
    assert r.loader == "fast" and r.iters == 3 and math.isfinite(r.last_loss)


@pytest.mark.parametrize("reader", ["dali", "blockprep", "torch"])
def test_classify2d_trains_on_a_class_tree(image_tree: Path, reader: str) -> None:
    report = train_classify2d.main([str(image_tree), "--reader", reader, "--iters", "3", "--batchsize", "4",
                                    "--size", "32", "--workers", "0"])  # fmt: skip
    assert report.reader == reader and report.iters == 3 and report.classes == 3
    assert math.isfinite(report.first_loss) and math.isfinite(report.last_loss)
    assert 0 <= report.wait_share < 1


def test_classify2d_labels_follow_readers_file(image_tree: Path) -> None:
    from loaders.faces.dali import list_labeled_files

    files, labels, classes = train_classify2d.class_tree(image_tree)
    expected = list_labeled_files(image_tree)
    assert [(str(Path(f).relative_to(image_tree)), label) for f, label in zip(files, labels)] == expected
    assert classes == sorted(classes) and len(classes) == 3


def test_classify2d_command_line_errors_exit_2(tmp_path: Path) -> None:
    for argv in ([str(tmp_path / "missing")], [str(tmp_path), "--reader", "pil"], [str(tmp_path), "--iters", "0"]):
        with pytest.raises(SystemExit) as exc:
            train_classify2d.main(argv)
        assert exc.value.code == 2, argv


def test_seg3d_command_line_errors_exit_2(tmp_path: Path) -> None:
    cache = ["--cache", str(tmp_path)]
    for argv in (["--cache", str(tmp_path / "missing")], [*cache, "--loader", "fastest"], [*cache, "--channels", "4"],
                 [*cache, "--iters", "0"]):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            train_seg3d.main(argv)
        assert exc.value.code == 2, argv


def test_seg3d_accepts_the_earlier_command_line(tmp_path: Path) -> None:
    """Job scripts written for the earlier options keep working: `--channels 4 8`, `--loader blockprep|both`."""
    args = train_seg3d.parse(["--cache", str(tmp_path), "--channels", "4", "8", "--loader", "both", "--workers", "0"])
    assert args.channels == [4, 8] and args.loader == "all" and args.workers == 0
    assert train_seg3d.parse(["--cache", str(tmp_path), "--loader", "blockprep"]).loader == "fast"
    assert train_seg3d.parse(["--cache", str(tmp_path), "--channels", "4,8,16"]).channels == [4, 8, 16]
