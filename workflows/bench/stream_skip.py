"""How fast a random stream is moved past a batch's items, in the thread or in the helper process.

    python -m workflows.bench.stream_skip --edge 96 --items 4

`Rand3DElasticd` draws three uniform numbers a voxel of each item (two generator words each), and the loader
moves its one stream past each item's words to give every item its start (`loaders.tail.stream`). Timed per
batch (median of `--batches`): in the thread item by item (`loaders.tail.ahead.skip`), and through the helper
process, alone and with a second thread running pure Python beside (as the tail's and the training loop's
Python run beside the stream's thread). The helper's start is not timed (it starts once per process, and gets
ready for such batches on a thread while the first are drawn in the thread).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--edge", type=int, default=96, help="the crop's edge: 2 * 3 * edge^3 words an item")
    parser.add_argument("--items", type=int, default=4, help="items a batch")
    parser.add_argument("--batches", type=int, default=15)
    a = parser.parse_args(argv)
    for line in run(a.edge, a.items, a.batches):
        print(line)
    return 0


def run(edge: int, items: int, batches: int) -> list[str]:
    import numpy as np

    from loaders.tail import stream
    from loaders.tail.ahead import skip

    words = 2 * (3 + 3 * edge**3)
    r = np.random.RandomState(0)

    def in_thread() -> None:
        for _ in range(items):
            r.get_state()
            skip(r, words)

    ways: dict[str, Callable[[], object]] = {
        "in the thread": in_thread,
        "helper": lambda: stream.starts(r, words, items),
    }
    stream.starts(r, words, items)  # started: drawn here while the helper gets ready
    stream.ready(60)
    lines = [f"{items} items of {words:,} words a batch (edge {edge}), ms a batch (median of {batches}):"]
    for beside in (False, True):
        stop = threading.Event()
        busy = threading.Thread(target=_python, args=(stop,), daemon=True)
        if beside:
            busy.start()
            time.sleep(0.05)
        try:
            got = {name: _median(way, batches) for name, way in ways.items()}
        finally:
            stop.set()
            if beside:
                busy.join()
        where = "beside a Python thread" if beside else "alone"
        lines.append(f"  {where}: " + ", ".join(f"{name} {ms:.2f}" for name, ms in got.items()))
    stream.close()
    return lines


def _python(stop: threading.Event) -> None:
    x = 0
    while not stop.is_set():
        for i in range(300):
            x += i


def _median(way: Callable[[], object], batches: int) -> float:
    import statistics

    times = []
    for _ in range(batches):
        t = time.perf_counter()
        way()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


if __name__ == "__main__":
    raise SystemExit(main())
