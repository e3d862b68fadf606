"""One table for every way measured in a run, with ratios, written as text, CSV, JSON and a bar chart."""

from __future__ import annotations

import csv
import json
import math
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from workflows.bench.core import Options, Result, Rows

PERSISTENT = "monai PersistentDataset"
COLUMNS = ("name", "data", "items/s", "GB/s", "x ceiling", "x peer", "note")
FIELDS = ["name", "data", "kind", "items", "seconds", "nbytes", "items_per_s", "gb_per_s", "x_ceiling", "x_peer",
          "peer", "note"]  # fmt: skip
KIND_COLOURS = {
    "ours": "tab:green",
    "peer": "tab:blue",
    "research": "tab:orange",
    "ceiling": "tab:gray",
    "reference": "tab:purple",
}


def ceiling_for(results: list[Result], data: str, cold: bool) -> Result | None:
    """The reference ceiling of a data set: O_DIRECT when cold, np.fromfile when warm, else any ceiling."""
    ceilings = [r for r in results if r.kind == "ceiling" and r.data == data]
    prefer = "O_DIRECT" if cold else "fromfile"
    for r in ceilings:
        if prefer in r.name:
            return r
    return ceilings[0] if ceilings else None


def ratios(results: list[Result], cold: bool, peers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Rows with items/s, GB/s, the ratio to the data set's ceiling and to its reference peer (`peers`:
    data set -> row name; MONAI PersistentDataset by default). None where the reference was not measured."""
    rows = []
    for r in results:
        ceiling = ceiling_for(results, r.data, cold)
        peer_name = (peers or {}).get(r.data, PERSISTENT)
        peer = next((p for p in results if p.name == peer_name and p.data == r.data), None)
        row = r.as_dict()
        row["x_ceiling"] = r.items_per_s / ceiling.items_per_s if ceiling else None
        row["x_peer"] = r.items_per_s / peer.items_per_s if peer else None
        row["peer"] = peer_name if peer else ""
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


def _note(row: dict[str, Any]) -> str:
    extra = ", ".join(f"{k} {_fmt(v, 1)}" for k, v in row.get("extra", {}).items())
    return "; ".join(x for x in (row["note"], extra) if x)


def table(rows: list[dict[str, Any]], skipped: Sequence[tuple[str, str]] = ()) -> str:
    """A fixed-width text table; the peers compared against and the ways that could not run follow it."""
    cells = [
        [r["name"], r["data"], _fmt(r["items_per_s"], 1), _fmt(r["gb_per_s"], 3), _fmt(r["x_ceiling"]),
         _fmt(r["x_peer"]), _note(r)]
        for r in rows
    ]  # fmt: skip
    widths = [max(len(c) for c in col) for col in zip(COLUMNS, *cells)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*COLUMNS), line.format(*("-" * w for w in widths))]
    out += [line.format(*c) for c in cells]
    peers = sorted({(r["data"], r["peer"]) for r in rows if r["peer"]})
    if peers:
        out.append("x peer: against " + "; ".join(f"{name} ({data})" for data, name in peers))
    if skipped:  # each printed its reason when it was tried; the table only names them
        out.append("unavailable here: " + ", ".join(name for name, _ in skipped))
    return "\n".join(s.rstrip() for s in out)


def environment(opts: Options) -> dict[str, Any]:
    """Where and how the run happened (goes into the JSON next to the rows, and into the plot's title)."""
    return {
        "date_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mode": "cold" if opts.cold else "warm",
        "device": opts.device,
        "batchsize": opts.batchsize,
        "batches": opts.batches,
        "workers": opts.workers,
    }


def write(out: Path, rows: list[dict[str, Any]], skipped: Sequence[tuple[str, str]], opts: Options,
          title: str = "", footer: Sequence[str] = ()) -> list[Path]:  # fmt: skip
    """Write bench.csv, bench.json and bench.png under `out`; returns the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows({**r, "note": _note(r)} for r in rows)
    env = environment(opts)
    doc = {"environment": env, "title": title, "results": rows, "unavailable": dict(skipped), "footer": list(footer)}
    (out / "bench.json").write_text(json.dumps(doc, indent=1, default=str))
    paths = [out / "bench.csv", out / "bench.json"]
    if rows:
        plot(rows, out / "bench.png", title=plot_title(env, title))
        paths.append(out / "bench.png")
    return paths


def plot_title(env: dict[str, Any], what: str = "") -> str:
    """Machine, date and settings, for the figure."""
    first = f"{what} - " if what else ""
    return (f"{first}{env['mode']} read, {env['batches']} batches of {env['batchsize']}, device {env['device']}\n"
            f"{env['host']} ({env['cpus']} CPUs), {env['date_utc']}")  # fmt: skip


def in_memory(row: dict[str, Any]) -> str:
    """'warm' or 'in RAM' for a row that did not read from the device ('' otherwise)."""
    note = str(row.get("note", ""))
    if "RAM" in note:
        return "in RAM"
    return "warm" if note.startswith("warm") or "(warm)" in row["name"] else ""


def plot(rows: list[dict[str, Any]], path: Path, title: str = "") -> None:
    """Horizontal bars of items/s from zero, one panel per data set, coloured by kind (legend), each bar
    labelled with its value; rows served from memory are hatched and say so."""
    import matplotlib

    matplotlib.use("Agg")  # no display on nodes; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    groups = sorted({r["data"] for r in rows}, key=lambda g: (g != "volumes", g))
    heights = [max(1, sum(r["data"] == g for r in rows)) for g in groups]
    fig, axes = plt.subplots(len(groups), 1, figsize=(10, 1.6 + 0.42 * sum(heights) + 0.6 * len(groups)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)  # fmt: skip
    for ax, group in zip(axes[:, 0], groups):
        mine = [r for r in rows if r["data"] == group]
        values = [r["items_per_s"] if math.isfinite(r["items_per_s"]) else 0.0 for r in mine]
        labels = [r["name"] + (f"  [{in_memory(r)}]" if in_memory(r) else "") for r in mine]
        bars = ax.barh(labels, values, color=[KIND_COLOURS.get(r["kind"], "tab:purple") for r in mine],
                       hatch=None, edgecolor="black", linewidth=0.4)  # fmt: skip
        for bar, r in zip(bars, mine):
            if in_memory(r):
                bar.set_hatch("//")
                bar.set_alpha(0.55)
        ax.bar_label(bars, labels=[f"{v:,.1f}" for v in values], padding=3, fontsize=7)
        ax.set_xlim(0, max(values + [1e-9]) * 1.18)  # linear from zero; room for the value labels
        ax.invert_yaxis()
        ax.set_title(group, fontsize=9, loc="left")
        ax.set_xlabel("items/s", fontsize=8)
        ax.tick_params(labelsize=7)
    kinds = [k for k in KIND_COLOURS if any(r["kind"] == k for r in rows)]
    handles = [Patch(facecolor=KIND_COLOURS[k], edgecolor="black", label=k) for k in kinds]
    if any(in_memory(r) for r in rows):
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="from memory (warm / in RAM)"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish(rows: Rows, opts: Options) -> int:
    """Print the table, write the files under `opts.out`; exit status 1 when only ceilings (or nothing) ran."""
    table_rows = ratios(rows.results, opts.cold, rows.peers)
    print()
    if rows.title:
        print(rows.title)
    print(table(table_rows, rows.skipped))
    if rows.footer:
        print("\n" + "\n".join(rows.footer))
    if opts.out is not None:
        written = write(opts.out, table_rows, rows.skipped, opts, rows.title, rows.footer)
        print("\nwrote " + ", ".join(str(p) for p in written))
    return 0 if any(r.kind != "ceiling" for r in rows.results) else 1
