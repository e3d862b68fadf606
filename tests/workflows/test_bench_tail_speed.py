"""Smoke test of the speed sanity script (tiny sizes; no timing is asserted)."""

from __future__ import annotations

import pytest

pytest.importorskip("monai")

from workflows.bench import tail_speed as speed  # noqa: E402


def test_speed_compare_runs_every_chain(capsys: pytest.CaptureFixture[str]) -> None:
    speed.main(["--size", "24", "--crop", "12", "--batch", "2", "--repeats", "1"])
    out = capsys.readouterr().out
    for name in speed.chains(12):
        assert name in out
    rows = speed.compare(size=24, crop=12, batch=2, device="cpu", repeats=1)
    assert [r["chain"] for r in rows] == list(speed.chains(12))
    assert all(r["batched_s"] > 0 and r["per_item_s"] > 0 for r in rows)
