"""prep.quarantine's checks in two parts: the cheap ones before the head, the .gz stream checks beside it."""

from __future__ import annotations

import gzip
from pathlib import Path

import nibabel as nib
import numpy as np

from prep.quarantine import check_file, split_checks, streams_check


def _nifti(path: Path) -> Path:
    data = np.random.default_rng(0).random((8, 8, 8)).astype(np.float32)
    nib.save(nib.Nifti1Image(data, np.eye(4)), path)
    return path


def test_only_gz_streams_are_left_for_beside_the_head(tmp_path: Path) -> None:
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
