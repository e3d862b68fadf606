"""workflows.bench.phases: a step's phases timed, the hand-over's calls timed and put back, the tool on the CPU."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from workflows.bench import profile_train
from workflows.bench.phases import handover_calls, parts_said, take_parts, takes_said, timed_steps


def test_each_phase_is_timed_where_it_is_spent() -> None:
    import time

    def step(image: int, label: int) -> None:
        time.sleep(0.004)

    def sync() -> None:
        time.sleep(0.002)

    p = timed_steps(itertools.repeat((0, 0)), step, sync, 5)
    assert p.steps == 5 and p.taking < 1.0
    assert 2.0 <= p.synced < 10.0 and 2.0 <= p.finishing < 10.0 and 4.0 <= p.launching < 20.0
    assert p.total == pytest.approx(p.taking + p.synced + p.launching + p.finishing)


def test_takes_are_told_by_the_phase_they_ran_in() -> None:
    """A take of 4 ms across the end of a step's launches and the start of its sync after, and one of 1 ms in the
    next step's sync after: each millisecond told in the phase it ran in (a step's mean), and the longest take."""
    marks = [(0.000, 0.001, 0.002, 0.012, 0.020), (0.021, 0.022, 0.023, 0.033, 0.041)]
    spans = [(0.010, 0.014, True), (0.035, 0.036, True)]
    said = takes_said(marks, spans, 3)
    assert "takes (2, on a thread)" in said and "max 4.00" in said
    assert "launches 1.00" in said and "synced after 1.50" in said and "between 0.00" in said
    assert "graphs captured a step 1.50" in said
    assert takes_said([], spans, 0) == "no takes timed"


def test_the_takes_parts_are_timed_and_put_back() -> None:
    from loaders.fast import feeder
    from loaders.tail import replay

    before = (feeder.Feeder._take, replay._made, replay._Chain._launch)
    with take_parts() as spent:
        assert replay._made is not before[1]
        replay._made([], "cpu")
        spent["takes"] += 1
    assert (feeder.Feeder._take, replay._made, replay._Chain._launch) == before
    assert spent["made on the device"] > 0 and spent["launches"] == 0
    assert parts_said(spent).startswith("ms a take: message 0.00") and parts_said({}) == "no take's parts timed"


def test_the_hand_over_hooks_are_put_back() -> None:
    from loaders.fast import feeder

    before = (feeder.Feeder._recv, feeder.Feeder._unpack, feeder.Feeder._send, feeder.loads)
    with handover_calls() as calls:
        assert feeder.Feeder._recv is not before[0] and feeder.loads is not before[3]
        feeder.loads(feeder.dumps(("credit",)))
    assert (feeder.Feeder._recv, feeder.Feeder._unpack, feeder.Feeder._send, feeder.loads) == before
    assert calls["message KB"][2] == 1 and calls["message KB"][0] > 0 and calls["loads"][2] == 1


def test_phases_run_on_the_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--workload", "mednist", "--count", "8", "--size", "32", "--steps", "3", "--device", "cpu",
            "--work", str(tmp_path), "--phases"]  # fmt: skip
    assert profile_train.main(argv) == 0
    out = capsys.readouterr().out
    fed = [line for line in out.splitlines() if line.startswith("feeder=True (batches made by ")]
    assert fed and "this process" not in fed[0]  # the feeder's batches, waited for
    assert "feeder=False (batches made by this process)" in out
    assert "takes (" in out  # the feeder's takes timed against the steps
    assert "ms a take: message " in out  # and their parts
    assert out.count("resident batch again") == 2 and "the hand-over's calls here" in out
    said = [line.split() for line in out.splitlines() if "random states a batch:" in line]
    assert said and int(said[0][4].rstrip(",")) >= 1  # mednist's random transforms, their states with each batch
