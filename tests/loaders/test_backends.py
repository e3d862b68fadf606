"""Every backend passes the same tests through one parametrised fixture; unavailable ones skip."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from loaders.backends import Backend, ReadRequest, backend_names, get_backend
from loaders.errors import BackendError, PrepError

CPU_BACKENDS = [n for n in backend_names() if n not in ("kvikio", "blockdev", "xnvme")]


@pytest.fixture(params=CPU_BACKENDS)
def backend(request: pytest.FixtureRequest) -> Backend:
    try:
        b = get_backend(request.param)
    except PrepError as exc:
        pytest.skip(f"{request.param} unavailable here: {exc}")
    request.addfinalizer(b.close)
    return b


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    payload = np.random.default_rng(1).integers(0, 256, 3 * 4096 + 123, dtype=np.uint8).tobytes()
    path = tmp_path / "data.bin"
    path.write_bytes(payload)
    return path, payload


def test_reads_batches_exactly(backend: Backend, data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    reqs = [
        ReadRequest(str(path), 0, 4096),
        ReadRequest(str(path), 4096, 8192),
        ReadRequest(str(path), 0, len(payload)),
    ]
    bufs = backend.read(reqs)
    for r, b in zip(reqs, bufs):
        assert bytes(b) == payload[r.offset : r.offset + r.nbytes]


def test_short_read_is_an_error(backend: Backend, data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    with pytest.raises(BackendError, match="short read"):
        backend.read([ReadRequest(str(path), 4096, len(payload))])


def test_missing_file(backend: Backend, tmp_path: Path) -> None:
    with pytest.raises(BackendError, match="cannot open"):
        backend.read([ReadRequest(str(tmp_path / "nope"), 0, 10)])


def test_unknown_backend_lists_known() -> None:
    with pytest.raises(BackendError, match="known backends: auto, .*posix"):
        get_backend("nope")


def test_import_loaders_is_light() -> None:
    import subprocess

    heavy = "('torch', 'monai', 'dask', 'kvikio', 'prep', 'nvidia.dali')"
    code = f"import loaders, loaders.backends, loaders.format, sys; print([m for m in {heavy} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
