"""`prep cache` bounds what an input may decode to, from its header, before decoding it."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from cacheutil import SPHERES
from PIL import Image
from typer.testing import CliRunner

from prep.cache import prepare_cache
from prep.cli import app
from prep.errors import PrepError
from prep.item_size import declared, parse_size
from prep.quarantine import check_file


def _nifti_claiming(path: Path, shape: tuple[int, ...], data: bytes = b"\0" * 4096) -> Path:
    """A .nii.gz whose header declares `shape` float32 voxels but whose stream holds only `data`."""
    header = nib.Nifti1Header()
    header.set_data_dtype(np.float32)
    header.set_data_shape(shape)
    header["vox_offset"] = 352
    path.write_bytes(gzip.compress(header.binaryblock + b"\0" * 4 + data))
    return path


def _datalist_with(root: Path, *images: Path) -> Path:
    from prep.synth import nifti_dataset

    datalist = nifti_dataset(root, count=2, size=16, seed=5)
    doc = json.loads(datalist.read_text())
    doc["training"] += [{"image": str(p), "label": "labelsTr/case_00000.nii.gz"} for p in images]
    datalist.write_text(json.dumps(doc))
    return datalist


def test_a_header_claiming_terabytes_is_quarantined_by_default(tmp_path: Path) -> None:
    """32767^3 float32 voxels (140 TB) in a file of a few kB: refused from the header, with the default bound,
    before the stream is read (else the reason would be the truncation)."""
    huge = _nifti_claiming(tmp_path / "huge.nii.gz", (32767, 32767, 32767))
    datalist = _datalist_with(tmp_path / "data", huge)
    t0 = time.perf_counter()
    summary = prepare_cache(datalist, SPHERES, tmp_path / "cache", workers=1, processes=False)
    assert time.perf_counter() - t0 < 60
    assert summary.n_items == 2 and [q["path"] for q in summary.quarantined] == [str(huge)]
    reason = summary.quarantined[0]["reason"]
    assert "32767x32767x32767 float32: 140.7 TB decoded, over --max-item-bytes" in reason, reason
    assert "pass a larger --max-item-bytes" in reason and "truncated" not in reason


def test_cli_small_bound_on_a_sound_file(tmp_path: Path) -> None:
    """A sound 16^3 float32 volume (16 kB) over --max-item-bytes 8K: quarantined, the rest cached, exit 1."""
    datalist = _datalist_with(tmp_path / "data")
    out = tmp_path / "cache"
    args = ["cache", str(datalist), "--pipeline", str(SPHERES), "--output", str(out), "--workers", "1",
            "--threads", "--max-item-bytes", "8K"]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 1, result.output
    assert "2 items quarantined" in result.output, result.output
    assert "16x16x16 float32: 16.4 kB decoded, over --max-item-bytes 8.0 kB" in result.output
    bad = CliRunner().invoke(app, [*args[:-1], "lots"])
    assert bad.exit_code == 1 and "error: --max-item-bytes 'lots' is not a size" in bad.output, bad.output


def test_gzip_stream_longer_than_the_bound_stops_early(tmp_path: Path) -> None:
    """A header that declares little over a stream that inflates to 32 MB: the stream is read only to the
    bound (1 MiB past it), and the file is refused, not inflated to its end."""
    bomb = _nifti_claiming(tmp_path / "bomb.nii.gz", (16, 16, 16), b"\0" * (32 << 20))
    reason = check_file(bomb, max_bytes=64 << 10)
    assert reason is not None and "decompresses to more than 1.1 MB, over --max-item-bytes 65.5 kB" in reason
    assert check_file(bomb, max_bytes=64 << 20) is None  # under a larger bound it is a sound file


def test_images_and_arrays_sized_from_their_headers(tmp_path: Path) -> None:
    Image.new("L", (4000, 3000)).save(tmp_path / "big.png")
    Image.new("RGB", (640, 480)).save(tmp_path / "photo.jpg")
    np.save(tmp_path / "vol.npy", np.zeros((10, 20, 30), np.int16))
    np.savez(tmp_path / "pair.npz", a=np.zeros((4, 4), np.float64), b=np.zeros(3, np.uint8))
    (tmp_path / "vol.nrrd").write_bytes(b"NRRD0004\ntype: short\ndimension: 3\nsizes: 100 200 300\n\n")
    (tmp_path / "vol.mha").write_bytes(b"ObjectType = Image\nNDims = 3\nDimSize = 10 10 10\n"
                                       b"ElementType = MET_FLOAT\nElementDataFile = LOCAL\n")  # fmt: skip
    assert declared(tmp_path / "big.png") == (12_000_000, "3000x4000x1 L pixels")
    assert declared(tmp_path / "photo.jpg") == (921_600, "480x640x3 RGB pixels")
    assert declared(tmp_path / "vol.npy") == (12_000, "10x20x30 int16")
    assert declared(tmp_path / "pair.npz") == (131, "4x4 float64 + 3 uint8")
    assert declared(tmp_path / "vol.nrrd") == (12_000_000, "100x200x300 short")
    assert declared(tmp_path / "vol.mha") == (4000, "10x10x10 MET_FLOAT")
    reason = check_file(tmp_path / "big.png", max_bytes=1 << 20)
    assert reason is not None and "3000x4000x1 L pixels: 12.0 MB decoded" in reason
    assert check_file(tmp_path / "big.png", max_bytes=12_000_000) is None


@pytest.mark.parametrize(("text", "value"), [("8G", 8 * 10**9), ("512Mi", 512 << 20), ("1.5GiB", 3 << 29),
                                             ("4096", 4096), ("2 kB", 2000)])  # fmt: skip
def test_sizes(text: str, value: int) -> None:
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "8X", "-1", "0", "1e9", "G"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(PrepError, match="^--max-item-bytes '"):
        parse_size(text)
