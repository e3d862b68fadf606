"""PinnedStager (GPU, marked `gpu`): slots are pinned and 4 KiB-aligned, O_DIRECT reads land in them
without a bounce buffer, uploads equal the bytes read, and a slot is not overwritten before its copy ends."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from loaders.backends import ReadRequest, get_backend  # noqa: E402
from loaders.cache.spec import ALIGN  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture
def stager() -> Any:
    if not torch.cuda.is_available():
        pytest.skip("no GPU here")
    from loaders.reading.staging import PinnedStager

    return PinnedStager("cuda:0", slots=2)


def test_slots_are_pinned_and_aligned(stager: Any) -> None:
    from loaders.backends.base import pinned_empty

    for n in (1, 4095, 3 << 20, (5 << 20) + 17):
        owner, view = pinned_empty(n)
        assert owner.is_pinned() and view.ctypes.data % ALIGN == 0 and view.nbytes == n
        assert view.ctypes.data == owner.data_ptr()
    for slot in (0, 1):
        buf = stager.host(slot, (2 << 20) + 100)
        assert buf.ctypes.data % ALIGN == 0 and buf.nbytes == (2 << 20) + 100


def test_direct_reads_into_slot_and_uploads(stager: Any, tmp_path: Path) -> None:
    payload = np.random.default_rng(4).integers(0, 256, 6 << 20, dtype=np.uint8)
    path = tmp_path / "f.bin"
    payload.tofile(path)
    with get_backend("direct", page_cache=False) as b:
        for k in range(4):  # more rounds than slots: each slot is reused after its copy finished
            slot, lo = k % 2, k * (1 << 20)
            buf = stager.host(slot, 2 << 20)
            # aligned slot and aligned request: the job targets the slot itself (no bounce buffer)
            (job,) = b._plan(ReadRequest(str(path), lo, 2 << 20), buf)
            assert job.copy_to is None and job.target.ctypes.data == buf.ctypes.data
            b.read_into([ReadRequest(str(path), lo, 2 << 20)], [buf])
            dev = stager.upload(slot, 2 << 20)
            assert dev.is_cuda
            np.testing.assert_array_equal(dev.cpu().numpy(), payload[lo : lo + (2 << 20)])


def test_slot_waits_for_its_copy(stager: Any) -> None:
    n = 64 << 20
    buf = stager.host(0, n)
    buf[:] = 7
    dev = stager.upload(0, n)
    again = stager.host(0, n)  # must block until the copy above has read the slot
    again[:] = 9
    assert int(dev.min()) == 7 and int(dev.max()) == 7


def test_a_slot_beyond_the_pin_limit_is_pageable_and_uploads_the_same(
    stager: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Batches of whole items larger than `tunables.PIN_MAX_BYTES` are staged in pageable memory (pinning them
    costs more than the copy: docs/benchmarks.md); below it the slot is pinned; the bytes uploaded are the same."""
    from loaders.reading import staging

    monkeypatch.setattr(staging, "PIN_MAX_BYTES", 4 << 20)
    payload = np.random.default_rng(5).integers(0, 256, 8 << 20, dtype=np.uint8)
    for k in range(4):  # each slot reused after its copy
        n = (1 << 20) if k < 2 else (8 << 20)
        buf = stager.host(k % 2, n)
        assert buf.ctypes.data % ALIGN == 0
        assert stager._slots[k % 2].is_pinned() == (k < 2)
        buf[:] = payload[:n]
        np.testing.assert_array_equal(stager.upload(k % 2, n).cpu().numpy(), payload[:n])
