"""The conformance table users read (docs/tail.md): every row of `transforms.TRANSFORMS` through PreparedLoader
and through the drop-in, against MONAI itself (same seed; per-item chain + list_data_collate, and
PersistentDataset), each verdict computed here and the table written between the markers of docs/tail.md.
The test fails when the committed table differs; `BLOCKPREP_WRITE_DOCS=1` rewrites it. A row that differs
from MONAI beyond its rounding bound, or crashes, fails the test: it is a bug, not a verdict.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from chaintable import Row
from monairef import Reference, assert_batch_equal
from test_dropin import check_dropin
from test_loader import QUICK, SEED, _loader
from transforms import TRANSFORMS

from loaders.errors import PrepError

DOC = Path(__file__).resolve().parents[2] / "docs" / "tail.md"
START, END = "<!-- conformance-table: start -->", "<!-- conformance-table: end -->"


def _how(loader: Any, name: str) -> str:
    """Where the loader ran the row's transform: folded into the read, batched, or per item through MONAI."""
    from loaders.tail import BatchedTail
    from loaders.tail.batched import batched_names

    asm = loader.assembly
    if asm.fold is not None and type(asm.fold.transform).__name__ == name:
        return "batched (crop folded into the read)"
    tail = asm.tail
    if isinstance(tail, BatchedTail) and name in batched_names() and name not in tail.fallbacks:
        return "batched"
    return "per item (MONAI's own transform)"


def loader_verdict(row: Row, caches: Any) -> str:
    """PreparedLoader over two epochs against MONAI's batches: exact, within the row's rounding, or refused."""
    try:
        loader, _ = _loader(row, caches(row), {**QUICK, "feeder": False})
    except PrepError as exc:
        assert "\n" not in str(exc), row.name
        return f"refused: {exc}"
    ref = Reference(row, caches.data(row), SEED)
    exact = True
    for epoch in range(2):
        for j, batch in enumerate(loader):
            want = ref.batch([int(i) for i in batch["_items"]])
            where = f"{row.name} epoch {epoch} batch {j}"
            try:
                assert_batch_equal(batch, want, 0.0, where, meta=False)
            except AssertionError:
                if not row.atol:  # bit for bit or a bug
                    raise
                exact = False
                assert_batch_equal(batch, want, row.atol, where, meta=False)
    how = _how(loader, row.name)
    loader.close()
    return f"{how}, exact" if exact else f"{how}, within float rounding (max abs difference {row.atol:g})"


def render(verdicts: dict[str, tuple[str, str]]) -> str:
    lines = [
        START,
        "<!-- written by tests/conformance/test_table.py: BLOCKPREP_WRITE_DOCS=1 pytest "
        "tests/conformance/test_table.py -->",
        "",
        "| MONAI transform | `PreparedLoader` | drop-in (`PreparedPersistentDataset`) |",
        "|---|---|---|",
        *(f"| `{name}` | {ours} | {dropin} |" for name, (ours, dropin) in verdicts.items()),
        "",
        END,
    ]
    return "\n".join(lines)


def _skip_reason() -> str | None:
    import monai.transforms as mt

    missing = [name for name in TRANSFORMS if not hasattr(mt, name)]
    return f"this MONAI has no {', '.join(missing)}" if missing else None


def test_conformance_table_is_monai_and_is_in_the_docs(caches: Any, tmp_path: Path) -> None:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    verdicts: dict[str, tuple[str, str]] = {}
    for row in TRANSFORMS.values():
        ours = loader_verdict(row, caches)
        check_dropin(row, caches, tmp_path / row.name, "dataloader-0")  # equal to PersistentDataset, or it fails
        verdicts[row.name] = (ours, "per item (MONAI's own transforms), exact")
    table = render(verdicts)
    text = DOC.read_text()
    assert START in text and END in text, f"{DOC}: the table's markers are missing"
    before, rest = text.split(START, 1)
    new = before + table + rest.split(END, 1)[1]
    if os.environ.get("BLOCKPREP_WRITE_DOCS") == "1":
        DOC.write_text(new)
        return
    assert new == text, f"{DOC}'s conformance table is not what the test found; regenerate it with " + (
        "BLOCKPREP_WRITE_DOCS=1 pytest tests/conformance/test_table.py"
    )
