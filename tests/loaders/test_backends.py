"""Every backend passes the same tests through one parametrised fixture; unavailable ones skip."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from forkutil import forked_exit

from loaders.backends import BLOCK_RANGE_BACKENDS, Backend, ReadRequest, backend_names, get_backend
from loaders.errors import BackendError, PrepError

# block-range backends need a bmap and a device: their own tests (loop images) cover them
CPU_BACKENDS = [n for n in backend_names() if n not in ("kvikio", "xnvme", *BLOCK_RANGE_BACKENDS)]
# Backends that need hardware or a system library: they run where it is present and skip with the reason.
PARAMS = [
    *CPU_BACKENDS,
    # test files are in the page cache right after writing: this one takes the O_DIRECT path regardless
    pytest.param(("direct", {"page_cache": False}), id="direct-o_direct-only"),
    pytest.param("xnvme", marks=pytest.mark.xnvme),
    pytest.param("kvikio", marks=pytest.mark.gpu),
]


@pytest.fixture(params=PARAMS)
def backend(request: pytest.FixtureRequest) -> Backend:
    name, options = request.param if isinstance(request.param, tuple) else (request.param, {})
    device = "cuda:0" if name == "kvikio" else "cpu"
    try:
        b = get_backend(name, device=device, **options)
    except PrepError as exc:
        pytest.skip(f"{name} unavailable here: {exc}")
    request.addfinalizer(b.close)
    return b


def to_host(buf: Any) -> bytes:
    """Bytes of a host array, cupy array or torch tensor (GPU backends fill device buffers)."""
    if hasattr(buf, "get") and not isinstance(buf, np.ndarray):  # cupy
        buf = buf.get()
    elif hasattr(buf, "cpu"):  # torch
        buf = buf.cpu().numpy()
    return bytes(np.asarray(buf).reshape(-1).view(np.uint8))


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
        assert to_host(b) == payload[r.offset : r.offset + r.nbytes]


def test_short_read_is_an_error(backend: Backend, data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    with pytest.raises(BackendError, match="short read"):
        backend.read([ReadRequest(str(path), 4096, len(payload))])


def test_missing_file(backend: Backend, tmp_path: Path) -> None:
    with pytest.raises(BackendError, match="cannot open"):
        backend.read([ReadRequest(str(tmp_path / "nope"), 0, 10)])


def test_unaligned_ranges_and_tail(backend: Backend, data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    size = len(payload)
    reqs = [
        ReadRequest(str(path), 1, 4095),  # unaligned start, ends on a block boundary
        ReadRequest(str(path), 4000, 200),  # crosses a block boundary
        ReadRequest(str(path), size - 123, 123),  # the unaligned tail up to end of file
        ReadRequest(str(path), 8191, size - 8191),  # unaligned start through end of file
        ReadRequest(str(path), 5, 0),
    ]
    for r, b in zip(reqs, backend.read(reqs)):
        assert to_host(b)[: r.nbytes] == payload[r.offset : r.offset + r.nbytes], r


def test_many_random_requests_in_one_batch(backend: Backend, data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    rng = np.random.default_rng(5)
    offs = rng.integers(0, len(payload) - 1, 64)
    reqs = [ReadRequest(str(path), int(o), int(rng.integers(1, len(payload) - o + 1))) for o in offs]
    for r, b in zip(reqs, backend.read(reqs)):
        assert to_host(b)[: r.nbytes] == payload[r.offset : r.offset + r.nbytes]


def test_read_into_caller_buffers(backend: Backend, data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    reqs = [ReadRequest(str(path), 4096, 8192), ReadRequest(str(path), 17, 5000)]
    if backend.gpu:
        bufs = [backend.allocate(r.nbytes + 100) for r in reqs]
    else:  # an aligned buffer, and one deliberately off alignment by one byte
        bufs = [backend.allocate(8192), np.zeros(5001, np.uint8)[1:]]
    backend.read_into(reqs, bufs)
    for r, b in zip(reqs, bufs):
        assert to_host(b)[: r.nbytes] == payload[r.offset : r.offset + r.nbytes]


def test_survives_pickling(backend: Backend, data_file: tuple[Path, bytes]) -> None:
    path, payload = data_file
    backend.read([ReadRequest(str(path), 0, 10)])  # opens descriptors and the pool before pickling
    with pickle.loads(pickle.dumps(backend)) as clone:
        (buf,) = clone.read([ReadRequest(str(path), 100, 5000)])
        assert to_host(buf) == payload[100:5100]


def _read_in_a_forked_child(backend: Backend, reqs: list[ReadRequest], payload: bytes) -> None:
    bufs = backend.read(reqs)
    sys.exit(0 if all(to_host(b) == payload[r.offset : r.offset + r.nbytes] for r, b in zip(reqs, bufs)) else 3)


def test_reads_in_a_forked_child_after_the_parent_read(backend: Backend, data_file: tuple[Path, bytes]) -> None:
    """A DataLoader worker forked after the parent read through the backend: the parent's pool threads are not
    in the child, so the child makes its own (it waited forever on work no thread ran)."""
    if backend.gpu:
        pytest.skip("a forked child cannot use its parent's CUDA context")
    path, payload = data_file
    reqs = [ReadRequest(str(path), 0, 4096), ReadRequest(str(path), 4096, 8192), ReadRequest(str(path), 17, 999)]
    backend.read(reqs)  # the parent's pool now running
    assert forked_exit(_read_in_a_forked_child, (backend, reqs, payload), "its parent's read pool") == 0


def test_unknown_backend_lists_known() -> None:
    with pytest.raises(BackendError, match="known backends: auto, .*posix"):
        get_backend("nope")


def test_import_loaders_is_light() -> None:
    import subprocess

    heavy = "('torch', 'monai', 'dask', 'kvikio', 'prep', 'nvidia.dali')"
    code = (
        f"import loaders, loaders.backends, loaders.cache.format, sys; print([m for m in {heavy} if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_loader_modules_import_no_face_or_concrete_backend() -> None:
    """The dataset needs no MONAI face (no import circle); region reads know backends by capability only."""
    import subprocess

    code = (
        "import sys, loaders.faces.dataset, loaders.faces.batches, loaders.cache.meta, loaders.reading.region; "
        "print(sorted(m for m in ('torch', 'monai', 'loaders.faces.monai', 'loaders.backends.posix', "
        "'loaders.backends.direct') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_page_cache_capability(data_file: tuple[Path, bytes]) -> None:
    """Buffered backends may have warm bytes copied out of a mapping; a pure O_DIRECT one may not."""
    path, payload = data_file
    with get_backend("posix") as posix, get_backend("direct") as direct:
        assert posix.page_cache_reads and direct.page_cache_reads
        assert posix.warm_reader() is posix
        warm = direct.warm_reader()
        assert warm is not direct and warm.page_cache_reads and warm is direct.warm_reader()
        (buf,) = warm.read([ReadRequest(str(path), 10, 100)])
        assert to_host(buf) == payload[10:110]
    with get_backend("direct", page_cache=False) as cold:
        assert not cold.page_cache_reads and cold.warm_reader() is cold
