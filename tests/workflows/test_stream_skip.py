"""The stream-skip benchmark runs (tiny) and prints both ways, alone and beside a Python thread."""

from __future__ import annotations

import re

from workflows.bench.stream_skip import run


def test_it_times_both_ways_alone_and_beside() -> None:
    lines = run(edge=8, items=3, batches=3)
    assert lines[0].startswith("3 items of 3,078 words a batch")
    for line, where in zip(lines[1:], ("alone", "beside a Python thread")):
        assert re.fullmatch(rf"  {where}: in the thread \d+\.\d\d, helper \d+\.\d\d", line), line
