"""PreparedPersistentDataset against MONAI's PersistentDataset, row by row: the same data, the
same chain built twice, seeded the row's way, under the same DataLoader; every batch equal."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from chaintable import ROWS, Row
from heldout import ALL
from monairef import assert_batch_equal, seeded
from transforms import TRANSFORMS

SEED = 11
LOADERS = ["dataloader-0", "dataloader-2", "thread"]


def _param(row: Row, *marks: Any) -> Any:
    return pytest.param(row, id=row.name, marks=list(marks))


def _batches(ds: Any, transform: Any, row: Row, kind: str) -> list[Any]:
    from monai.data import DataLoader, ThreadDataLoader

    if row.seeding == "loader":
        transform.set_random_state(SEED)  # the user's habit with MONAI: seed the chain, then iterate
    torch.manual_seed(SEED)  # the workers' seeds (MONAI's worker_init_fn re-seeds each worker's chain)
    if kind == "thread":
        loader = ThreadDataLoader(ds, batch_size=2, num_workers=0)
    else:
        loader = DataLoader(ds, batch_size=2, num_workers=int(kind[-1]), timeout=120 if kind[-1] != "0" else 0)
    return list(loader)


def check_dropin(row: Row, caches: Any, tmp_path: Path, kind: str) -> None:
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    cache, data = caches(row), caches.data(row)
    with seeded(row, SEED) as theirs:
        ref = PersistentDataset(data, theirs, tmp_path / "pt")
        for i in range(len(data)):  # fill its cache first: on the run that fills it, PersistentDataset hands
            ref[i]  # the tail the head's MetaTensors; from its cache, plain tensors (track_meta=False), as we do
    with seeded(row, SEED) as ours:
        ds = PreparedPersistentDataset(data, ours, cache, backend="posix")
    if row.raises:
        for d, t in ((ref, theirs), (ds, ours)):
            with pytest.raises(Exception, match=row.raises):
                _batches(d, t, row, kind)
        return
    want = _batches(ref, theirs, row, kind)
    got = _batches(ds, ours, row, kind)
    assert len(got) == len(want) == -(-len(data) // 2)
    for j, (g, w) in enumerate(zip(got, want)):
        assert_batch_equal(g, w, where=f"{row.name} {kind} batch {j}")


QUICK_ROWS = [_param(r) for r in ALL.values() if not r.slow and r.name not in TRANSFORMS]  # those: test_table.py


@pytest.mark.parametrize("row", QUICK_ROWS)
def test_dropin_equals_persistent_dataset(row: Row, caches: Any, tmp_path: Path) -> None:
    check_dropin(row, caches, tmp_path, "dataloader-0")


def _under_each_loader() -> list[Any]:
    """The issue's rows under each loader; the held-out rows under one, in turn (workers re-raise wrapped)."""
    rows = [r for r in ALL.values() if not r.raises]
    return [
        pytest.param(row, kind, id=f"{row.name}-{kind}")
        for j, row in enumerate(rows)
        for kind in (LOADERS[1:] if row.name in ROWS else [LOADERS[1 + j % 2]])
    ]


@pytest.mark.slow
@pytest.mark.parametrize(("row", "kind"), _under_each_loader())
def test_dropin_equals_persistent_dataset_under_each_loader(row: Row, kind: str, caches: Any, tmp_path: Path) -> None:
    check_dropin(row, caches, tmp_path, kind)


MAPPED_ROWS = ["nested-compose", "ho-nested-head-and-tail", "same-object-twice", "intensity-all-fire",
               "crop-flip-rot90", "ho-copy-in-head"]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "kind"), [(n, "dataloader-0") for n in MAPPED_ROWS] + [("nested-compose", "dataloader-2")]
)
def test_dropin_through_mapped_item_reads_equals_persistent_dataset(
    name: str, kind: str, caches: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every item read as copy-on-write mappings (`Reader.mapped`: these rows' items are small, so the threshold
    is lowered to 0), with nested Composes and tails that write in place: batches equal PersistentDataset's."""
    from loaders.reading import reads

    monkeypatch.setattr(reads, "INLINE_BYTES", 0)
    mapped: list[bool] = []
    real = reads.Reader.mapped

    def spy(self: Any, plan: Any) -> Any:
        got = real(self, plan)
        mapped.append(got is not None)
        return got

    monkeypatch.setattr(reads.Reader, "mapped", spy)
    check_dropin(ALL[name], caches, tmp_path, kind)
    if kind == "dataloader-0":
        assert mapped and all(mapped)  # every item of this process came mapped
