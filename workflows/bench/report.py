"""One table for every way measured in a run, with ratios, written as text, CSV, JSON and a bar chart."""

from __future__ import annotations

import csv
import json
import math
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workflows.bench.core import Options, Result

PERSISTENT = "monai PersistentDataset"
COLUMNS = ("name", "data", "items/s", "GB/s", "x ceiling", "x PersistentDataset", "note")


def ceiling_for(results: list[Result], data: str, cold: bool) -> Result | None:
    """The reference ceiling of a data set: O_DIRECT when cold, np.fromfile when warm, else any ceiling."""
    ceilings = [r for r in results if r.kind == "ceiling" and r.data == data]
    prefer = "O_DIRECT" if cold else "fromfile"
    for r in ceilings:
        if prefer in r.name:
            return r
    return ceilings[0] if ceilings else None


def ratios(results: list[Result], cold: bool) -> list[dict[str, Any]]:
    """Rows with items/s, GB/s and the two ratios (None where the reference was not measured)."""
    rows = []
    for r in results:
        ceiling = ceiling_for(results, r.data, cold)
        persistent = next((p for p in results if p.name == PERSISTENT and p.data == r.data), None)
        row = r.as_dict()
        row["x_ceiling"] = r.items_per_s / ceiling.items_per_s if ceiling else None
        row["x_persistent"] = r.items_per_s / persistent.items_per_s if persistent else None
        rows.append(row)
    return rows


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value):
            return "inf"
        return f"{value:.{digits}f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


def table(rows: list[dict[str, Any]], skipped: Sequence[tuple[str, str]] = ()) -> str:
    """A fixed-width text table; ways that could not run are listed under it, one line each."""
    cells = [
        [r["name"], r["data"], _fmt(r["items_per_s"], 1), _fmt(r["gb_per_s"], 3), _fmt(r["x_ceiling"]),
         _fmt(r["x_persistent"]), r["note"]]
        for r in rows
    ]  # fmt: skip
    widths = [max(len(c) for c in col) for col in zip(COLUMNS, *cells)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*COLUMNS), line.format(*("-" * w for w in widths))]
    out += [line.format(*c) for c in cells]
    if skipped:  # each printed its reason when it was tried; the table only names them
        out.append("unavailable here: " + ", ".join(name for name, _ in skipped))
    return "\n".join(s.rstrip() for s in out)


def environment(opts: Options) -> dict[str, Any]:
    """Where and how the run happened (goes into the JSON next to the rows)."""
    import os

    return {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mode": "cold" if opts.cold else "warm",
        "device": opts.device,
        "batchsize": opts.batchsize,
        "batches": opts.batches,
        "workers": opts.workers,
    }


def write(out: Path, rows: list[dict[str, Any]], skipped: list[tuple[str, str]], opts: Options) -> list[Path]:
    """Write bench.csv, bench.json and bench.png under `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    fields = ["name", "data", "kind", "items", "seconds", "nbytes", "items_per_s", "gb_per_s", "x_ceiling",
              "x_persistent", "note"]  # fmt: skip
    with open(out / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    env = environment(opts)
    doc = {"environment": env, "results": rows, "unavailable": dict(skipped)}
    (out / "bench.json").write_text(json.dumps(doc, indent=1, default=str))
    paths = [out / "bench.csv", out / "bench.json"]
    if rows:
        plot(rows, out / "bench.png", title=f"{env['mode']} read, {opts.device}")
        paths.append(out / "bench.png")
    return paths


def plot(rows: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Horizontal bars of items/s, one panel per data set, ours highlighted, ceilings hatched."""
    import matplotlib

    matplotlib.use("Agg")  # no display on nodes; must precede pyplot
    import matplotlib.pyplot as plt

    groups = sorted({r["data"] for r in rows}, key=lambda g: (g != "volumes", g))
    heights = [max(1, sum(r["data"] == g for r in rows)) for g in groups]
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 1 + 0.45 * sum(heights) + len(groups)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)  # fmt: skip
    colours = {"ours": "tab:green", "peer": "tab:blue", "research": "tab:orange", "ceiling": "tab:gray"}
    for ax, group in zip(axes[:, 0], groups):
        mine = [r for r in rows if r["data"] == group]
        ax.barh(
            [r["name"] for r in mine],
            [r["items_per_s"] for r in mine],
            color=[colours.get(r["kind"], "tab:purple") for r in mine],
        )
        ax.invert_yaxis()
        ax.set_title(f"{group}", fontsize=9, loc="left")
        ax.set_xscale("log")  # in-RAM peers and warm ceilings are orders of magnitude above cold reads
        ax.set_xlabel("items/s (log scale)")
        ax.tick_params(labelsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
