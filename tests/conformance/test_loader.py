"""PreparedLoader against MONAI itself, row by row of the conformance table.

The quick suite runs each row once (CPU, no tier, crop reads, tail in the read thread, two epochs); the
slow matrix runs every row over tier / crop_read / tail_thread / a DDP shard.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from chaintable import ROWS, Row
from heldout import ALL
from monairef import Reference, assert_batch_equal, differs, seeded
from transforms import TRANSFORMS
from tutorials import TUTORIALS

from loaders.cache.chain import track_meta_switch
from loaders.errors import PrepError

SEED = 11
QUICK = {"gpu_budget": 0, "crop_read": "auto", "tail_thread": True}
MATRIX = [
    {"gpu_budget": budget, "crop_read": crop, "tail_thread": thread, "shard": shard}
    for budget, crop, thread, shard in itertools.product([0, "1GiB"], [True, False], [True, False], [None, (0, 2)])
]
HELDOUT_MATRIX = [MATRIX[i] for i in (6, 9)]


def _param(row: Row, *marks: Any) -> Any:
    more = [pytest.mark.xfail(strict=True, reason=row.xfail)] if row.xfail else []
    return pytest.param(row, id=row.name, marks=[*marks, *more])


def _loader(row: Row, cache: Path, options: dict[str, Any]) -> tuple[Any, Any]:
    """(loader seeded the row's way, its transform)."""
    from loaders.fast.loader import PreparedLoader

    options = dict(options)
    shard = options.pop("shard", None)
    batch = row.loader.get("batch_size", 2)
    more = {k: v for k, v in row.loader.items() if k != "batch_size"}
    if track_meta_switch(row.tail()) is not None:  # MONAI 1.4's RandSimulateLowResolution: tail_thread=True
        options["tail_thread"] = None  # is refused, the loader's default runs the tail on this thread
    with seeded(row, SEED) as transform:
        loader = PreparedLoader(cache, transform, batch, device="cpu", drop_last=False, **options, **more)
    if shard is not None:
        loader.shard(*shard)
    if row.seeding == "loader":
        loader.set_random_state(SEED)
    return loader, transform


def check_row(row: Row, caches: Any, options: dict[str, Any], epochs: int = 2) -> None:
    cache = caches(row)
    if row.refused:
        with pytest.raises(PrepError, match=row.refused) as info:
            _loader(row, cache, options)
        assert "\n" not in str(info.value)
        return
    loader, _ = _loader(row, cache, options)
    if row.raises:
        with pytest.raises(Exception, match=row.raises):
            list(loader)
        return
    ref = Reference(row, caches.data(row), SEED)
    for epoch in range(epochs):
        seen = []
        for j, batch in enumerate(loader):
            items = [int(i) for i in batch["_items"].reshape(-1)]
            assert batch["_items"].ndim == 1
            assert_batch_equal(batch, ref.batch(items), row.atol, f"{row.name} epoch {epoch} batch {j}", meta=False)
            seen += items
        assert set(seen) == {int(i) for i in loader.epoch_items(epoch)}, (row.name, epoch, seen)
    loader.close()


@pytest.mark.parametrize("row", [_param(r) for r in ALL.values() if not r.slow and r.name not in TRANSFORMS])
def test_row_equals_monai(row: Row, caches: Any) -> None:
    check_row(row, caches, QUICK)


def _over_the_matrix() -> list[Any]:
    """Every (row, options): the issue's rows over the whole matrix, the held-out rows over two settings
    that give each option both its values (the suite stays a few minutes on two cores)."""
    out = []
    for row in (r for r in ALL.values() if not r.refused):
        for options in MATRIX if row.name in ROWS else HELDOUT_MATRIX:
            more = [pytest.mark.xfail(strict=True, reason=row.xfail)] if row.xfail else []
            name = "-".join(f"{k}={v}" for k, v in options.items())
            out.append(pytest.param(row, options, id=f"{row.name}-{name}", marks=more))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(("row", "options"), _over_the_matrix())
def test_row_equals_monai_over_the_matrix(row: Row, options: dict[str, Any], caches: Any) -> None:
    check_row(row, caches, options)


@pytest.mark.parametrize("name", ["crop-flip-rot90", *TUTORIALS, *TRANSFORMS])
def test_another_seed_differs(name: str, caches: Any) -> None:
    """The negative control: the comparison sees a different seed (a first row, every tutorial chain, every
    transform of the table in docs/tail.md)."""
    row = ALL[name]
    loader, _ = _loader(row, caches(row), QUICK)
    ref = Reference(row, caches.data(row), SEED + 1)
    assert any(differs(b, ref.batch([int(i) for i in b["_items"]])) for b in loader)


def test_the_raising_rows_raise_in_monai_too(caches: Any) -> None:
    from monai.data import list_data_collate

    for row in (r for r in ALL.values() if r.raises):
        caches(row)
        ref = Reference(row, caches.data(row), SEED)
        with pytest.raises(Exception, match=row.raises):
            list_data_collate([out for i in range(len(ref.data)) for out in ref.item(i)])


@pytest.mark.parametrize(
    ("name", "options"),
    [
        ("crop-flip-rot90", {**QUICK, "prefetch": 2}),
        ("crop-flip-rot90", {**QUICK, "prefetch": 3, "tail_thread": False}),
        ("posneg-num-samples", {**QUICK, "prefetch": 3, "gpu_budget": "1GiB"}),
    ],
)
def test_leaving_an_epoch_early_keeps_later_epochs(name: str, options: dict[str, Any], caches: Any) -> None:
    """Draws follow delivery: batches read ahead and never delivered leave no trace in later epochs."""
    row = ROWS[name]
    loader, _ = _loader(row, caches(row), options)
    ref = Reference(row, caches.data(row), SEED)
    for batch in loader:  # one batch of epoch 0, then leave it
        assert_batch_equal(batch, ref.batch([int(i) for i in batch["_items"]]), where="epoch 0", meta=False)
        break
    for j, batch in enumerate(loader):
        assert_batch_equal(batch, ref.batch([int(i) for i in batch["_items"]]), where=f"epoch 1 batch {j}", meta=False)
