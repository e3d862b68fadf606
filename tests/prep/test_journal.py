"""prep.journal: only sealed, intact journal lines whose shard bytes exist are trusted."""

from __future__ import annotations

from pathlib import Path

from loaders.cache.journals import JournalWriter
from loaders.cache.spec import JOURNAL_DIR
from prep.journal import read_journals


def _record(item: int, shard: str) -> dict:
    return {"item": item, "shard": shard, "tensors": [{"key": "image", "offset": 0, "nbytes": 8, "dtype": "uint8",
            "shape": [8], "xxh3": 1}], "meta": {"source": {"image": f"{item}.nii"}}}  # fmt: skip


def test_damaged_torn_and_unsealed_lines_are_not_trusted(tmp_path: Path) -> None:
    (tmp_path / JOURNAL_DIR).mkdir()
    (tmp_path / "s.bin").write_bytes(bytes(4096))
    path = tmp_path / JOURNAL_DIR / "a.jsonl"
    with JournalWriter(path) as journal:
        journal.append_many([_record(i, "s.bin") for i in range(4)])
    assert set(read_journals(tmp_path).done) == {0, 1, 2, 3}
    lines = path.read_bytes().splitlines()
    assert lines[1].count(b'"shape":[8]') == 1
    lines[1] = lines[1].replace(b'"shape":[8]', b'"shape":[9]')  # still valid JSON: a damaged digit
    lines[2] = b'{"item":2,"shard":"s.bin","tensors":[]}'  # valid JSON, no seal
    lines[3] = lines[3][: len(lines[3]) // 2]  # torn
    path.write_bytes(b"\n".join(lines) + b"\n")
    assert set(read_journals(tmp_path).done) == {0}
