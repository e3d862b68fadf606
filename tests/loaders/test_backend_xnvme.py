"""XnvmeBackend: clear errors without libxnvme; device block ranges against a real loop device with it.

The file API is covered by the shared tests in test_backends.py (the `xnvme` param). Tests that need
libxnvme are marked `xnvme` and skip with the reason where it cannot be loaded (point
XNVME_LIBRARY_PATH at a libxnvme.so to run them).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from loaders.backends import ReadRequest, get_backend
from loaders.errors import BackendError, MissingDependencyError, PrepError


def test_missing_bindings_say_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "xnvme", None)
    with pytest.raises(MissingDependencyError, match=r"blockprep\[xnvme\]"):
        get_backend("xnvme")


def test_block_range_reader_is_registered_and_needs_libxnvme(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from loaders.backends import BLOCK_RANGE_BACKENDS, backend_class, backend_names
    from loaders.blockmap.bmap import BlockMap, encode_document

    assert "xnvme-bmap" in backend_names() and "xnvme-bmap" in BLOCK_RANGE_BACKENDS
    assert backend_class("xnvme-bmap").name == "xnvme-bmap"
    doc = {"format": "blockprep-bmap", "version": "1.0", "root": str(tmp_path), "device": "/dev/null", "files": {}}
    (tmp_path / "bmap.json").write_bytes(encode_document(doc))
    monkeypatch.setitem(sys.modules, "xnvme", None)
    with pytest.raises(MissingDependencyError, match=r"blockprep\[xnvme\]"):
        get_backend("xnvme-bmap", bmap=BlockMap.load(tmp_path / "bmap.json"), device_path="/dev/null")


def test_missing_library_is_a_clear_error() -> None:
    pytest.importorskip("xnvme", reason="the xnvme bindings are not installed (pip install 'blockprep[xnvme]')")
    code = (
        "from loaders.backends import get_backend\n"
        "from loaders.errors import MissingDependencyError\n"
        "try:\n    get_backend('xnvme')\nexcept MissingDependencyError as e:\n    print('MISSING', e)\n"
        "else:\n    print('LOADED')\n"
    )
    env = {**os.environ, "XNVME_LIBRARY_PATH": "/nonexistent/libxnvme.so", "LD_LIBRARY_PATH": ""}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    if out.startswith("LOADED"):
        pytest.skip("libxnvme is installed system-wide here, so the missing-library path cannot happen")
    assert "libxnvme cannot be loaded" in out and "XNVME_LIBRARY_PATH" in out


@pytest.fixture
def xnvme_backend() -> Callable[..., object]:
    def make(**options: object) -> object:
        try:
            return get_backend("xnvme", **options)
        except PrepError as exc:
            pytest.skip(f"xnvme unavailable here: {exc}")

    return make


@pytest.mark.xnvme
def test_device_ranges_need_a_device_and_a_real_path(xnvme_backend: Callable[..., object], tmp_path: Path) -> None:
    b = xnvme_backend()
    with pytest.raises(BackendError, match="device_uri"):
        b.read_device_ranges([(0, 10)])  # type: ignore[attr-defined]
    b.close()  # type: ignore[attr-defined]
    b = xnvme_backend(device_uri=str(tmp_path / "nope"))
    with pytest.raises(BackendError, match="nope: cannot open with xnvme"):
        b.read_device_ranges([(0, 10)])  # type: ignore[attr-defined]


@pytest.fixture
def loop_device(tmp_path: Path) -> Iterator[tuple[str, bytes]]:
    """A read-only loop device over an image of random bytes."""
    if os.geteuid() != 0 or not Path("/dev/loop-control").exists():
        pytest.skip("loop devices need root and /dev/loop-control")
    payload = np.random.default_rng(9).integers(0, 256, 4 << 20, dtype=np.uint8).tobytes()
    image = tmp_path / "dev.img"
    image.write_bytes(payload)
    dev = subprocess.run(["losetup", "-r", "--find", "--show", str(image)], capture_output=True, text=True)
    if dev.returncode:
        pytest.skip(f"losetup failed: {dev.stderr.strip()}")
    yield dev.stdout.strip(), payload
    subprocess.run(["losetup", "-d", dev.stdout.strip()], check=False)


@pytest.mark.xnvme
@pytest.mark.loopdev
def test_device_ranges_on_a_loop_device(xnvme_backend: Callable[..., object], loop_device: tuple[str, bytes]) -> None:
    uri, payload = loop_device
    ranges = [(0, 4096), (512 * 7 + 3, 10_000), (1 << 20, 3 << 20), (len(payload) - 100, 100)]
    with xnvme_backend(device_uri=uri, chunk=256 * 1024, threads=4) as b:  # type: ignore[attr-defined]
        for (off, n), buf in zip(ranges, b.read_device_ranges(ranges)):
            assert bytes(buf) == payload[off : off + n]


def _extents(path: Path) -> list[tuple[int, int, int]]:
    """(logical byte, physical byte, nbytes) of each extent, from `filefrag -v` (FIEMAP)."""
    out = subprocess.run(["filefrag", "-v", str(path)], capture_output=True, text=True, check=True).stdout
    block = int(re.search(r"blocks of (\d+) bytes", out).group(1))  # type: ignore[union-attr]
    rows = re.findall(r"^\s*\d+:\s+(\d+)\.\.\s*\d+:\s+(\d+)\.\.\s*\d+:\s+(\d+):", out, re.M)
    return [(int(lo) * block, int(ph) * block, int(n) * block) for lo, ph, n in rows]


@pytest.mark.xnvme
@pytest.mark.loopdev
def test_file_bytes_through_its_block_map(
    xnvme_backend: Callable[..., object], make_loopfs: Callable[..., object]
) -> None:
    fs = make_loopfs("ext4", size_mb=32)
    payload = np.random.default_rng(4).integers(0, 256, 1_500_000, dtype=np.uint8).tobytes()
    path = Path(fs.mountpoint) / "vol.bin"  # type: ignore[attr-defined]
    path.write_bytes(payload)
    os.sync()
    ranges = [(phys, min(n, len(payload) - lo)) for lo, phys, n in _extents(path)]
    assert sum(n for _, n in ranges) == len(payload)
    with xnvme_backend(device_uri=fs.device) as b:  # type: ignore[attr-defined]
        got = b"".join(bytes(x) for x in b.read_device_ranges(ranges))
        assert got == payload
        (head,) = b.read([ReadRequest(str(path), 0, 4096)])  # the same backend reads files too
        assert bytes(head) == payload[:4096]
