"""Seed 000's GPU variants in one run, at small sizes, in a few minutes on a GPU machine:

    bash workflows/gpu_kit.sh python3 -m workflows.seeds_gpu --out bench_out/seeds_gpu
    python -m workflows.seeds_gpu --device cpu --count 3 --size 24 --out /tmp/s   # the same path on a CPU box

(a) `prep cache` on seed 000's chain as the notebook writes it (`EnsureTypeD(device=...)` in the head, `SpacingD`,
    the random tail), run as a user runs it: its CLI with the default worker choice; it must exit 0 with nothing
    quarantined. (b) `--epochs` epochs of the seed's loader, `ThreadDataLoader(batch_size=1)`, over MONAI's
    `PersistentDataset`, MONAI's `GDSDataset` (where kvikio imports and the device is a GPU) and the drop-in
    `PreparedPersistentDataset` on that cache, each epoch seeded alike (`set_determinism(seed=epoch)`): seconds
    per epoch, the drop-in's speed against each, where and how the outputs come back, and whether every tensor
    equals `PersistentDataset`'s (values, dtype, device, shape). (c) `dali-readers` with DALI's decoder (the GPU
    "mixed" one on a GPU), `--rounds` interleaved rounds, where DALI is installed.

Prints each part and writes OUT/summary.json; exit status 1 when a check fails.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any

import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def seed000_chain(device: str, crop: int) -> str:
    """Seed 000's "Setup transforms" cell (the `gds-seed` workload's text: one copy of the seed's chain)."""
    from workflows.bench.workloads import _gds_pipeline

    return _gds_pipeline(SimpleNamespace(device=device, crop=crop))


def prepare(datalist: Path, pipeline: Path, cache: Path, workers: int) -> dict[str, Any]:
    """(a) `prep cache DATALIST --pipeline P --output C --workers N` in a process of its own, as typed."""
    from loaders.cache.spec import MANIFEST

    cmd = [sys.executable, "-m", "prep", "cache", str(datalist), "--pipeline", str(pipeline), "--output", str(cache)]
    start = time.perf_counter()
    done = subprocess.run([*cmd, "--workers", str(workers)], capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    print(done.stdout + done.stderr, end="", flush=True)
    manifest = cache / MANIFEST
    quarantined = json.loads(manifest.read_text()).get("quarantined") or [] if manifest.is_file() else None
    return {
        "command": "python " + " ".join(cmd[1:]) + f" --workers {workers}",
        "exit": done.returncode,
        "seconds": round(seconds, 2),
        "quarantined": None if quarantined is None else len(quarantined),
        "ok": done.returncode == 0 and quarantined == [],
    }


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def run_epochs(dataset: Any, epochs: int, device: str) -> tuple[list[float], list[list[Any]]]:
    """The seed's loop: `ThreadDataLoader(dataset, batch_size=1)`, every batch taken; seconds and outputs."""
    from monai.data import ThreadDataLoader
    from monai.utils import set_determinism

    seconds, outputs = [], []
    for epoch in range(epochs):
        set_determinism(seed=epoch)  # MONAI's loader then seeds the dataset's transform alike for every dataset
        start = time.perf_counter()
        items = list(ThreadDataLoader(dataset, batch_size=1))
        _sync(device)
        seconds.append(round(time.perf_counter() - start, 4))
        outputs.append(items)
    return seconds, outputs


def where(item: dict[str, Any]) -> dict[str, str]:
    """Type, dtype and device of each output tensor of one batch."""
    return {k: f"{type(v).__name__} {v.dtype} {v.device}" for k, v in item.items() if hasattr(v, "device")}


def differences(want: list[list[Any]], got: list[list[Any]]) -> list[str]:
    """Where `got` differs from `want` (values, dtype, device, shape of every tensor, every epoch): [] if nowhere."""
    import torch

    out = []
    for e, (we, ge) in enumerate(zip(want, got)):
        if len(we) != len(ge):
            out.append(f"epoch {e}: {len(ge)} items, not {len(we)}")
        for i, (w, g) in enumerate(zip(we, ge)):
            for k in w:
                a, b = w[k], g.get(k)
                if not hasattr(a, "device"):
                    continue
                if b is None or (a.dtype, a.device, a.shape) != (b.dtype, b.device, b.shape):
                    out.append(f"epoch {e} item {i} {k}: {where(g).get(k)} vs {where(w)[k]}")
                elif not torch.equal(torch.as_tensor(a), torch.as_tensor(b)):
                    diff = (torch.as_tensor(a).double() - torch.as_tensor(b).double()).abs().max().item()
                    out.append(f"epoch {e} item {i} {k}: values differ (max |diff| {diff:.3g})")
    return out


def gds_unavailable(device: str) -> str | None:
    """Why MONAI's GDSDataset cannot run here (None: it can)."""
    if not device.startswith("cuda"):
        return "GDSDataset reads into GPU memory: needs a cuda device"
    try:
        import kvikio.numpy  # noqa: F401
    except Exception as exc:  # noqa: BLE001  # a wheel that imports but cannot load its library raises others
        return f"kvikio does not import ({type(exc).__name__}: {exc}); carry its wheels in .whl/"
    return None


def loaders_part(data: list[Any], transform: Any, cache: Path, work: Path, epochs: int, device: str) -> dict[str, Any]:
    """(b) The three datasets under the seed's loader, the drop-in last (the peers' first epochs fill theirs)."""
    from monai.data import PersistentDataset

    from loaders import PreparedPersistentDataset

    makers: dict[str, Any] = {
        "PersistentDataset": lambda: PersistentDataset(data=data, transform=transform, cache_dir=work / "persistent")
    }
    why_not = gds_unavailable(device)
    if why_not is None:
        from monai.data import GDSDataset

        index = int(device.partition(":")[2] or 0)
        makers["GDSDataset"] = lambda: GDSDataset(data=data, transform=transform, cache_dir=work / "gds", device=index)
    makers["PreparedPersistentDataset"] = lambda: PreparedPersistentDataset(data, transform, cache_dir=cache)
    rows: dict[str, Any] = {}
    outputs: dict[str, list[list[Any]]] = {}
    for name, make in makers.items():
        seconds, outputs[name] = run_epochs(make(), epochs, device)
        rows[name] = {"seconds": seconds, "outputs": where(outputs[name][0][0])}
        print(f"  {name}: epochs {seconds} s; {rows[name]['outputs']}", flush=True)
    ours = rows["PreparedPersistentDataset"]["seconds"]
    for name in rows:
        if name != "PreparedPersistentDataset":
            speed = [round(p / o, 2) if o > 0 else None for p, o in zip(rows[name]["seconds"], ours)]
            rows["PreparedPersistentDataset"][f"x {name} per epoch"] = speed
            print(f"  drop-in speed x {name} per epoch: {speed}", flush=True)
    diffs = {n: differences(outputs["PersistentDataset"], outputs[n]) for n in outputs if n != "PersistentDataset"}
    for name, found in diffs.items():
        print(f"  {name} vs PersistentDataset: {'equal' if not found else found[:3]}", flush=True)
    wanted = "cuda" if device.startswith("cuda") else "cpu"
    on_device = all(f" {wanted}" in d for d in rows["PreparedPersistentDataset"]["outputs"].values())
    return {"rows": rows, "gds_skipped": why_not, "differences": diffs, "drop_in_on_head_device": on_device,
            "ok": on_device and not any(diffs.values())}  # fmt: skip


def dali_part(out: Path, device: str, images: int, rounds: int) -> dict[str, Any]:
    """(c) `dali-readers --decode` (DALI's "mixed" GPU decoder on a GPU) on a small JPEG tree."""
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        return {"skipped": "DALI is not installed here (pip install nvidia-dali-cuda130 where the box has one)"}
    from prep.synth import image_tree
    from workflows import benchmark

    classes = 4
    image_tree(out / "images", classes, max(1, images // classes), size=160, seed=1, force=True)
    batch = min(32, images)
    argv = ["--batchsize", str(batch), "--batches", str(max(1, images // batch)), "--device", device, "--warm",
            "--out", str(out / "dali"), "dali-readers", "--datadir", str(out / "images"), "--decode",
            "--rounds", str(rounds)]  # fmt: skip
    status = benchmark.main(argv)
    doc = json.loads((out / "dali" / "bench.json").read_text()) if (out / "dali" / "bench.json").is_file() else {}
    rows = {r["name"]: {"items_per_s": round(r["items_per_s"]), **r.get("extra", {})} for r in doc.get("results", [])}
    labels_ok = any(line.startswith("labels: every way") for line in doc.get("footer", []))
    return {"command": "python -m workflows.benchmark " + " ".join(argv), "exit": status, "rows": rows,
            "ok": status == 0 and labels_ok}  # fmt: skip


@app.command()
def main(
    out: Annotated[Path, typer.Option(help="working folder: data, caches, summary.json")] = Path("bench_out/seeds_gpu"),
    device: Annotated[str, typer.Option(help="the seed's device (cuda:0 on the GPU box, cpu elsewhere)")] = "cuda:0",
    count: Annotated[int, typer.Option(min=1, help="volumes")] = 12,
    size: Annotated[int, typer.Option(min=8, help="edge of each volume (voxels)")] = 128,
    epochs: Annotated[int, typer.Option(min=1, help="epochs of each dataset")] = 3,
    workers: Annotated[int, typer.Option(min=1, help="prep cache --workers")] = 4,
    images: Annotated[int, typer.Option(min=4, help="JPEGs for the DALI part")] = 1600,
    rounds: Annotated[int, typer.Option(min=1, help="dali-readers --rounds")] = 3,
) -> None:
    """Seed 000's chain through `prep cache` and the drop-in beside MONAI's datasets, and DALI's GPU decoder.

    Example: bash workflows/gpu_kit.sh python3 -m workflows.seeds_gpu --out bench_out/seeds_gpu
    """
    from prep.pipeline import load_pipeline
    from prep.synth import nifti_dataset

    out.mkdir(parents=True, exist_ok=True)
    for old in ("cache", "peers", "dali"):  # a run again starts cold: no cache of an earlier run is reused
        shutil.rmtree(out / old, ignore_errors=True)
    datalist = nifti_dataset(out / "volumes", count=count, size=size, seed=7, force=True)
    pipeline = out / "seed000.py"
    pipeline.write_text(seed000_chain(device, max(8, size * 2 // 3)))
    summary: dict[str, Any] = {"device": device, "count": count, "size": size}
    print(f"(a) prep cache, seed 000's chain on {device}", flush=True)
    summary["prep_cache"] = prepare(datalist, pipeline, out / "cache", workers)
    if summary["prep_cache"]["ok"]:
        from prep.cache import load_datalist

        print(f"(b) {epochs} epochs of ThreadDataLoader(batch_size=1)", flush=True)
        data = [entry for _, entry in load_datalist(datalist)]
        transform = load_pipeline(pipeline).transform
        summary["loaders"] = loaders_part(data, transform, out / "cache", out / "peers", epochs, device)
    print(f"(c) dali-readers --decode on {device}", flush=True)
    summary["dali"] = dali_part(out, device, images, rounds)
    parts = [summary["prep_cache"], summary.get("loaders", {"ok": False}), summary["dali"]]
    summary["ok"] = all(p.get("ok", "skipped" in p) for p in parts)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"{'all checks passed' if summary['ok'] else 'A CHECK FAILED'}: {out / 'summary.json'}", flush=True)
    if not summary["ok"]:
        raise typer.Exit(1)


if __name__ == "__main__":
    app()
