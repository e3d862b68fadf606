"""KvikioBackend: install hints without kvikio; on a GPU (marked `gpu`), bytes read into device memory
equal the file's bytes, in cupy and torch buffers, with kvikio's settings applied."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from loaders import backends
from loaders.backends import ReadRequest, get_backend
from loaders.backends.direct import DirectBackend
from loaders.backends.posix import PosixBackend
from loaders.errors import BackendError, MissingDependencyError, PrepError


def test_missing_kvikio_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvikio", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'blockprep\[gpu\]'"):
        get_backend("kvikio", device="cuda:0")


def test_auto_on_cuda_stages_direct_without_kvikio(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "kvikio", None)
    with get_backend("auto", device="cuda:0") as b:
        assert isinstance(b, DirectBackend)
    monkeypatch.setitem(backends._AUTO_ORDER, "cuda", ["kvikio", "posix"])
    with get_backend("auto", device="cuda:0") as b:
        assert isinstance(b, PosixBackend)


class _ModeProbe(PosixBackend):
    """A host backend standing in for kvikio in the auto rule (kvikio itself needs a GPU): it reports a
    `mode` as KvikioBackend does and records whether auto closed it."""

    gpu = True
    mode = "compat"
    closed: list[str] = []

    def __init__(self, device: str = "cuda:0", **options: Any) -> None:
        super().__init__(**options)

    def close(self) -> None:
        super().close()
        self.closed.append(self.mode)


@pytest.mark.parametrize(("mode", "stage_cold"), [("compat", False), ("compat", True), ("gds", False)])
def test_auto_takes_kvikio_with_gds_or_staged_cold_reads(
    monkeypatch: pytest.MonkeyPatch, mode: str, stage_cold: bool
) -> None:
    monkeypatch.setattr(_ModeProbe, "mode", mode)
    monkeypatch.setattr(_ModeProbe, "stage_cold", stage_cold, raising=False)
    monkeypatch.setattr(_ModeProbe, "closed", [])
    monkeypatch.setitem(backends._REGISTRY, "kvikio", f"{__name__}:_ModeProbe")
    with get_backend("auto", device="cuda:0") as b:
        assert isinstance(b, _ModeProbe if mode == "gds" or stage_cold else DirectBackend)
    # the compat-mode one was closed by auto (its threads released), the GDS one by the `with`
    assert _ModeProbe.closed == [mode]


def test_host_device_string_is_refused() -> None:
    with pytest.raises(BackendError, match="not a CUDA device"):
        get_backend("kvikio", device="cpu")


def test_no_gpu_is_a_backend_error() -> None:
    pytest.importorskip("kvikio", reason="kvikio is not installed (pip install 'blockprep[gpu]')")
    from loaders.deps import cuda_available, has

    if cuda_available() or has("cupy"):
        pytest.skip("a GPU (or cupy) is present here: the no-GPU path cannot be taken")
    with pytest.raises(BackendError, match=r"cuda:0 not present \(0 CUDA devices\)"):
        get_backend("kvikio", device="cuda:0")


def test_kvikio_errors_become_short_reads_past_eof(tmp_path: Path) -> None:
    from loaders.backends.kvikio import _failure

    path = tmp_path / "f.bin"
    path.write_bytes(b"x" * 10_000)
    eof = RuntimeError("KvikIO failure: POSIX error on pread: EOF")  # what kvikio 26.10 raises
    assert "short read at offset 4096 (5904 of 8000 bytes)" in str(_failure(ReadRequest(str(path), 4096, 8000), eof))
    other = _failure(ReadRequest(str(path), 0, 100), RuntimeError("device lost"))
    assert "read failed at offset 0 (device lost)" in str(other)


@pytest.fixture
def gpu_backend() -> Any:
    def make(**options: Any) -> Any:
        try:
            return get_backend("kvikio", device=options.pop("device", "cuda:0"), **options)
        except PrepError as exc:
            pytest.skip(f"kvikio unavailable here: {exc}")

    return make


@pytest.fixture
def payload_file(tmp_path: Path) -> tuple[Path, bytes]:
    payload = np.random.default_rng(2).integers(0, 256, (9 << 20) + 1234, dtype=np.uint8).tobytes()
    path = tmp_path / "vol.bin"
    path.write_bytes(payload)
    return path, payload


@pytest.mark.gpu
@pytest.mark.parametrize("array", ["cupy", "torch"])
def test_reads_into_gpu_memory(gpu_backend: Any, payload_file: tuple[Path, bytes], array: str) -> None:
    if array == "cupy":
        pytest.importorskip("cupy", reason="cupy is not installed (pip install cupy-cuda12x)")
    path, payload = payload_file
    reqs = [ReadRequest(str(path), 0, len(payload)), ReadRequest(str(path), 4096 * 7, 1 << 20)]
    reqs += [ReadRequest(str(path), 4096 * i + 13, 50_000 + i) for i in range(32)]
    with gpu_backend(threads=8, task_size=1 << 20, array=array) as b:
        bufs = b.read(reqs)
        for r, buf in zip(reqs, bufs):
            if array == "cupy":
                assert type(buf).__module__.startswith("cupy") and buf.device.id == 0
                host = buf.get()
            else:
                assert buf.is_cuda
                host = buf.cpu().numpy()
            assert host.tobytes() == payload[r.offset : r.offset + r.nbytes]


@pytest.mark.gpu
def test_settings_and_mode_reported(gpu_backend: Any) -> None:
    with gpu_backend(threads=6, task_size=2 << 20) as b:
        import kvikio
        import kvikio.defaults

        assert kvikio.defaults.get("num_threads") == 6
        assert kvikio.defaults.get("task_size") == 2 << 20
        assert b.mode == ("compat" if kvikio.defaults.is_compat_mode_preferred() else "gds")
    with gpu_backend(compat=True) as b:
        assert b.mode == "compat"
    with gpu_backend(direct_io=True):
        assert kvikio.defaults.get("auto_direct_io_read") is True
    with gpu_backend(direct_io=False):
        assert kvikio.defaults.get("auto_direct_io_read") is False


@pytest.mark.gpu
def test_direct_io_reads_are_exact(gpu_backend: Any, payload_file: tuple[Path, bytes]) -> None:
    path, payload = payload_file
    reqs = [ReadRequest(str(path), 0, len(payload)), ReadRequest(str(path), 4096 * 3 + 7, (2 << 20) + 5)]
    with gpu_backend(direct_io=True, compat=True, array="torch") as b:
        for r, buf in zip(reqs, b.read(reqs)):
            assert buf.cpu().numpy().tobytes() == payload[r.offset : r.offset + r.nbytes]
    with gpu_backend(direct_io=False):
        pass  # leave kvikio's process-wide default as it was for the tests after this one


@pytest.mark.gpu
def test_missing_device_index(gpu_backend: Any) -> None:
    gpu_backend().close()  # skips where kvikio or a GPU is missing
    with pytest.raises(BackendError, match="not present"):
        get_backend("kvikio", device="cuda:99")


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.gpu
def test_cold_requests_are_staged_through_o_direct(gpu_backend: Any, payload_file: tuple[Path, bytes]) -> None:
    path, payload = payload_file
    reqs = [ReadRequest(str(path), 0, 3 << 20), ReadRequest(str(path), (3 << 20) + 11, (5 << 20) + 7)]
    with gpu_backend(compat=True, array="torch") as b:
        assert b.stage_cold and b._direct is not None
        _evict(path)
        if b._cold(reqs) != {0, 1}:
            pytest.skip("the page cache cannot be probed or evicted here")
        for r, buf in zip(reqs, b.read(reqs)):  # cold: O_DIRECT into pinned memory, then copied
            assert buf.cpu().numpy().tobytes() == payload[r.offset : r.offset + r.nbytes]
        path.read_bytes()  # now cached: kvikio reads it
        assert b._cold(reqs) == set()
        for r, buf in zip(reqs, b.read(reqs)):
            assert buf.cpu().numpy().tobytes() == payload[r.offset : r.offset + r.nbytes]
    with gpu_backend(compat=True, stage_cold=False) as b:
        assert b._cold(reqs) == set() and b._direct is None
