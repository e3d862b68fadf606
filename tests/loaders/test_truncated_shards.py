"""A shard this user owns, truncated under a reader (issue 48, finding 8): the reader gets one line naming the
shard, never SIGBUS. Items handed out hold no mapping of a shard (a tail's output is copied out of it where it
still views one), so a truncation after the read cannot kill the process that holds them; a read after the
truncation names the shard. Each case runs in a child process: a SIGBUS would kill the test run itself."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from loaders.cache.writing import write_items

pytest.importorskip("torch")

_CHILD = textwrap.dedent(
    """
    import os, sys
    from loaders import PreparedDataset
    from loaders.errors import PrepError
    root, how = sys.argv[1], sys.argv[2]
    crop = (lambda d: {k: v[:, 8:24, 8:24, 8:24] for k, v in d.items()}) if how == "view-crop" else None
    ds = PreparedDataset(root, backend="posix", meta=False, transform=crop)
    held = [ds[0], ds[2]]  # items kept past the truncation (a tail's crop views the item: copied on the way out)
    shard = os.path.join(root, "shards", sorted(os.listdir(os.path.join(root, "shards")))[0])
    os.truncate(shard, 4096)
    print("held", sum(float(x[k].sum()) for x in held for k in x), flush=True)
    try:
        ds[2]
    except PrepError as exc:
        print("refused", str(exc).splitlines()[0], flush=True)
    """
)


@pytest.mark.parametrize("how", ["plain", "view-crop"])
def test_a_shard_truncated_under_a_reader_is_an_error_naming_it(tmp_path: Path, how: str) -> None:
    rng = np.random.default_rng(0)
    items = [{"image": rng.random((1, 64, 64, 64), dtype=np.float32)} for _ in range(3)]  # 1 MiB: mapped reads
    root = write_items(tmp_path / "c", items).root
    (shard,) = (Path(root) / "shards").glob("*.bin")
    run = subprocess.run([sys.executable, "-c", _CHILD, str(root), how], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"killed by signal {-run.returncode}" if run.returncode < 0 else run.stderr
    lines = run.stdout.splitlines()
    want = sum(float(x["image"].sum() if how == "plain" else x["image"][:, 8:24, 8:24, 8:24].sum())
               for x in (items[0], items[2]))  # fmt: skip
    assert lines[0].startswith("held ") and np.isclose(float(lines[0].split()[1]), want, rtol=1e-4), lines
    assert lines[1].startswith(f"refused {shard}: short read"), lines
