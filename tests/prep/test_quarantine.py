"""prep.quarantine's checks in two parts: the cheap ones before the head, then the .gz streams, whose decoded
bytes the head's nibabel reads (prep.inflated) instead of inflating each file again."""

from __future__ import annotations

import gzip
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from nibabel.filebasedimages import ImageFileError

from prep.inflated import served
from prep.quarantine import check_file, split_checks, streams_check


def _nifti(path: Path) -> Path:
    data = np.random.default_rng(0).random((8, 8, 8)).astype(np.float32)
    nib.save(nib.Nifti1Image(data, np.eye(4)), path)
    return path


def test_only_gz_streams_are_left_for_the_stream_checks(tmp_path: Path) -> None:
    gz, plain = _nifti(tmp_path / "a.nii.gz"), _nifti(tmp_path / "b.nii")
    bad, streams = split_checks({"image": str(gz), "label": str(plain)})
    assert bad is None and [p for p, _ in streams] == [str(gz)]
    assert streams_check(streams) is None
    raw = bytearray(gz.read_bytes())
    raw[len(raw) // 2] ^= 0x04  # inside the stream, past the header: the cheap checks pass, the stream fails
    gz.write_bytes(bytes(raw))
    bad, streams = split_checks({"image": str(gz)})
    assert bad is None and len(streams) == 1
    late = streams_check(streams)
    assert late is not None and late[0] == str(gz) and "gzip" in late[1]
    assert check_file(gz) == late[1]  # the whole check says the same


def test_cheap_failures_stop_before_any_stream_is_read(tmp_path: Path) -> None:
    gz = _nifti(tmp_path / "a.nii.gz")
    short = tmp_path / "short.nii"
    short.write_bytes(_nifti(tmp_path / "c.nii").read_bytes()[:400])
    bad, streams = split_checks({"image": str(gz), "label": str(short)})
    assert bad is not None and bad[0] == str(short) and "truncated NIfTI" in bad[1] and streams == []
    bad, _ = split_checks({"image": str(tmp_path / "none.nii.gz")})
    assert bad == (str(tmp_path / "none.nii.gz"), "missing file")
    cut = tmp_path / "cut.nii.gz"
    cut.write_bytes(gzip.compress(b"\0" * 100)[:20])  # a damaged stream whose header cannot be read either
    bad, streams = split_checks({"image": str(cut)})
    assert bad is not None and "gzip" in bad[1] and streams == []  # the stream's reason, as before the split


def test_the_head_reads_the_checked_bytes_and_the_same_tensors(tmp_path: Path) -> None:
    """The kept bytes are the file's decoded stream; MONAI's LoadImaged reads them inside `served` (the file
    itself is not opened again) and gives the same tensor and meta as from the file; outside, the file."""
    from monai.transforms import LoadImaged

    gz, plain = _nifti(tmp_path / "a.nii.gz"), _nifti(tmp_path / "b.nii")
    bad, streams = split_checks({"image": str(gz), "label": str(plain)})
    kept: dict[str, bytes] = {}
    assert bad is None and streams_check(streams, kept) is None
    assert list(kept) == [str(gz)] and kept[str(gz)] == gzip.decompress(gz.read_bytes())
    load = LoadImaged(keys="image", image_only=False)
    want = load({"image": str(gz)})
    gz.write_bytes(gzip.compress(b"not what was checked"))  # the head must not read the file again
    with served(kept):
        got = load({"image": str(gz)})
    assert np.array_equal(got["image"].numpy(), want["image"].numpy()) and got["image"].dtype == want["image"].dtype
    assert str(got["image_meta_dict"]["filename_or_obj"]) == str(gz)
    with pytest.raises(
        (RuntimeError, ImageFileError)
    ):  # outside the block the (now damaged) file is what nibabel opens
        load({"image": str(gz)})


def test_a_damaged_stream_keeps_nothing(tmp_path: Path) -> None:
    gz = _nifti(tmp_path / "a.nii.gz")
    raw = bytearray(gz.read_bytes())
    raw[len(raw) // 2] ^= 0x04
    gz.write_bytes(bytes(raw))
    kept: dict[str, bytes] = {}
    _, streams = split_checks({"image": str(gz)})
    assert streams_check(streams, kept) is not None and kept == {}
