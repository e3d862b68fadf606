"""3D UNet segmentation on a prepared cache, and how much of each step waits for data.

\b
    python -m workflows.train_seg3d --cache demo/cache --iters 50                       # blockprep fast path
    python -m workflows.train_seg3d --cache demo/cache --device cuda:0 --gpu-budget 8GiB
    python -m workflows.train_seg3d --cache demo/cache --loader drop-in --iters 50       # PreparedPersistentDataset
    python -m workflows.train_seg3d --cache demo/cache --loader all --device cuda:0      # one after the other
    python -m workflows.train_seg3d --cache demo/cache --iters 500 --checkpoint run.ckpt  # SIGUSR1: save, exit 3

`fast` (the default) is `loaders.PreparedLoader`: batches ready on the device, the random tail run there
over the whole batch, reads overlapped with compute, items kept on the GPU up to `--gpu-budget`.
`drop-in` reads the head's output with `PreparedPersistentDataset` (the one-line MONAI drop-in) under a
DataLoader, tail per item on the CPU; `persistent` runs MONAI's `PersistentDataset` over the same datalist
and pipeline (its .pt files are written before timing starts). A plain loop with DiceLoss, Adam, and bf16
autocast on GPU. The report: the share of step time spent waiting for the next batch.

With `--checkpoint FILE` (one loader), SIGUSR1 makes the run save the model, the optimiser, the step, the
losses and the loader's state at the next step boundary (atomically) and exit with status 3; started again
with the same FILE it goes on from there (`workflows/slurm/train.sbatch` requeues on SLURM's time-limit
signal). `fast` resumes exactly: the batches after the resume are those of a run that never stopped;
`drop-in` and `persistent` (a torch DataLoader) resume the model and optimiser but start a new shuffle.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

DEFAULT_PIPELINE = Path(__file__).parent / "pipelines" / "spheres.py"


class Loader(str, Enum):
    """Which loader feeds the model."""

    fast = "fast"
    drop_in = "drop-in"
    persistent = "persistent"
    all = "all"
    blockprep = "blockprep"  # the earlier names of fast and all, still accepted (job scripts use them)
    both = "both"


OLD_NAMES = {"blockprep": "fast", "both": "all"}


@dataclass
class Args:
    """The command line's settings."""

    cache: Path
    pipeline: Path | None = None
    loader: str = "fast"
    backend: str = "auto"
    gpu_budget: str = "0"
    persistent_dir: Path | None = None
    iters: int = 20
    batchsize: int = 2
    workers: int = 2
    device: str = "cpu"
    amp: bool = True
    channels: list[int] = field(default_factory=lambda: [16, 32, 64, 128])
    lr: float = 1e-3
    seed: int = 0
    json: Path | None = None
    checkpoint: Path | None = None
    log_every: int = 0


@dataclass
class TrainReport:
    """What one run measured."""

    loader: str
    iters: int
    seconds: float
    wait_seconds: float
    first_loss: float
    last_loss: float
    losses: list[float] = field(default_factory=list)  # every step's, from step 1 (a resumed run's too)
    resumed_at: int = 0  # steps the checkpoint this run resumed from had done

    @property
    def wait_share(self) -> float:
        """Fraction of step time spent waiting for data (0..1)."""
        return self.wait_seconds / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """One human-readable summary line."""
        return (f"{self.loader:>10}: {self.iters} steps in {self.seconds:.2f} s, {self.seconds / self.iters * 1e3:.1f}"
                f" ms/step, waiting for data {100 * self.wait_share:.1f}% of step time, loss "
                f"{self.first_loss:.3f} -> {self.last_loss:.3f}")  # fmt: skip


def cache_sources(cache_dir: Path) -> list[dict[str, Any]]:
    """The datalist entries the cache was made from (in item order)."""
    from loaders.cache.format import PreparedCache

    cache = PreparedCache(cache_dir)
    return [cache.meta(i)["source"] for i in range(len(cache))]


def choose_pipeline(cache_dir: Path, given: Path | None) -> Path:
    """The pipeline file to run: the one the user names, else the shipped demo pipeline when the cache was
    made with exactly that file (its recorded sha256 matches). Never a file because the cache names it: a
    cache can come from anyone, and its checksums can be recomputed by whoever edits it."""
    from loaders.cache.format import read_manifest
    from prep.errors import UsageError
    from prep.pipeline import file_sha256

    if given is not None:
        return given
    manifest = read_manifest(cache_dir)
    recorded = manifest.get("pipeline")
    if manifest.get("pipeline_sha256") == file_sha256(DEFAULT_PIPELINE):
        print(f"pipeline: {DEFAULT_PIPELINE} (the shipped demo pipeline; the cache was made with the same file)")
        return DEFAULT_PIPELINE
    raise UsageError(
        f"{cache_dir}: made with the pipeline {recorded!s:.200}, which is not the shipped demo pipeline; a cache "
        f"never picks the code that runs: pass --pipeline PIPELINE.py (that file, if you trust it)"
    )


def make_dataset(args: Args, loader: str) -> Any:
    """The training dataset of one loader: both apply the full pipeline, only where the head comes from differs."""
    from prep.pipeline import load_pipeline

    data = cache_sources(args.cache)
    transform = load_pipeline(choose_pipeline(args.cache, args.pipeline)).transform
    transform.set_random_state(seed=args.seed)  # the loaders draw the same crops and flips
    if loader == "fast":
        from loaders.fast.loader import PreparedLoader

        fast = PreparedLoader(args.cache, transform, args.batchsize, device=args.device, gpu_budget=args.gpu_budget,
                              backend=args.backend, seed=args.seed, drop_last=False)  # fmt: skip
        return fast.set_random_state(args.seed)
    if loader == "drop-in":
        from loaders import PreparedPersistentDataset

        options: dict[str, Any] = {}
        if args.backend == "blockdev":
            options["backend_options"] = {"bmap": str(args.cache / "bmap.json")}
        return PreparedPersistentDataset(data, transform, args.cache, backend=args.backend, **options)
    from monai.data import PersistentDataset

    persistent_dir = args.persistent_dir or args.cache.parent / f"{args.cache.name}_persistent"
    persistent_dir.mkdir(parents=True, exist_ok=True)
    dataset = PersistentDataset(data, transform, cache_dir=persistent_dir)
    for i in range(len(dataset)):  # write the .pt files first: steady-state reading is what is compared
        dataset[i]
    return dataset


def make_model(channels: tuple[int, ...], device: str) -> Any:
    """A small 3D UNet (1 input channel, background/foreground output)."""
    from monai.networks.nets import UNet

    return UNet(spatial_dims=3, in_channels=1, out_channels=2, channels=channels,
                strides=(2,) * (len(channels) - 1), num_res_units=1).to(device)  # fmt: skip


def _batches(dataset: Any, args: Args, loader_name: str) -> Any:
    """Endless shuffled batches (epochs chained); crops of every item are flattened into the batch."""
    import torch
    from monai.data import DataLoader, list_data_collate

    if loader_name == "fast":  # batches come ready on the device; each pass is the next epoch
        while True:
            yield from dataset
    loader = DataLoader(dataset, batch_size=args.batchsize, shuffle=True, num_workers=args.workers,
                        collate_fn=list_data_collate, generator=torch.Generator().manual_seed(args.seed),
                        pin_memory=args.device.startswith("cuda"), persistent_workers=args.workers > 0)  # fmt: skip
    while True:
        yield from loader


def _plain(x: Any) -> Any:
    return x.as_tensor() if hasattr(x, "as_tensor") else x


class Stopped(Exception):  # noqa: N818  (a state: the run saved a checkpoint and stopped on request)
    """The run stopped on SIGUSR1 after saving its checkpoint at `step`."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped after step {step}")
        self.step = step


def _settings(args: Args, loader: str) -> dict[str, Any]:
    """What must not change across a resume."""
    return {"loader": loader, "seed": args.seed, "batchsize": args.batchsize, "channels": list(args.channels),
            "lr": args.lr}  # fmt: skip


def _save(args: Args, loader: str, step: int, dataset: Any, model: Any, optimiser: Any, losses: list[float]) -> None:
    import torch

    from workflows import resume

    state = dataset.state_dict() if hasattr(dataset, "state_dict") else None  # PreparedLoader; not a DataLoader
    assert args.checkpoint is not None
    resume.save(args.checkpoint, {"settings": _settings(args, loader), "step": step, "losses": list(losses),
                                  "model": model.state_dict(), "optimiser": optimiser.state_dict(),
                                  "torch_rng": torch.get_rng_state(), "loader_state": state})  # fmt: skip
    epoch = f", epoch {state['epoch']} batch {state['batch']}" if state else " (no loader state: a new shuffle)"
    print(f"checkpoint saved at step {step}{epoch}: {args.checkpoint}", flush=True)


def _resume(args: Args, loader: str, dataset: Any, model: Any, optimiser: Any) -> tuple[int, list[float]]:
    """Load `args.checkpoint` into the model, optimiser and loader; returns (steps done, their losses)."""
    import torch

    from workflows import resume

    assert args.checkpoint is not None
    saved = resume.load(args.checkpoint, _settings(args, loader))
    model.load_state_dict(saved["model"])
    optimiser.load_state_dict(saved["optimiser"])
    torch.set_rng_state(saved["torch_rng"])
    if saved["loader_state"] is not None and hasattr(dataset, "load_state_dict"):
        dataset.load_state_dict(saved["loader_state"])
    print(f"resumed from {args.checkpoint} at step {saved['step']}", flush=True)
    return int(saved["step"]), [float(x) for x in saved["losses"]]


def train(args: Args, loader: str, stop: Any = None) -> TrainReport:
    """Run `args.iters` steps with one loader; time spent in `next(batches)` and the copy to the device is waiting.
    `stop` (a workflows.resume.StopRequest): once it is requested, save `args.checkpoint` and raise Stopped."""
    import torch
    from monai.losses import DiceLoss

    torch.manual_seed(args.seed)
    cuda = args.device.startswith("cuda")
    dataset = make_dataset(args, loader)
    model = make_model(tuple(args.channels), args.device)
    optimiser = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = DiceLoss(to_onehot_y=True, softmax=True)
    amp = cuda and args.amp
    first, losses = 0, list[float]()
    if args.checkpoint is not None and args.checkpoint.exists():
        first, losses = _resume(args, loader, dataset, model, optimiser)
    batches = _batches(dataset, args, loader)
    wait = 0.0
    start = time.perf_counter()
    for step in range(first + 1, args.iters + 1):
        t0 = time.perf_counter()
        batch = next(batches)
        image = _plain(batch["image"]).to(args.device, non_blocking=True)
        label = _plain(batch["label"]).to(args.device, non_blocking=True)
        if cuda:
            torch.cuda.synchronize(args.device)  # the copy is part of waiting for data
        wait += time.perf_counter() - t0
        optimiser.zero_grad(set_to_none=True)
        with torch.autocast("cuda" if cuda else "cpu", dtype=torch.bfloat16, enabled=amp):
            loss = loss_fn(model(image), label)
        loss.backward()  # bf16 needs no loss scaling
        optimiser.step()
        losses.append(float(loss.detach()))  # .item() syncs: the step's compute is finished here
        if args.log_every and step % args.log_every == 0:
            print(f"step {step}/{args.iters} loss {losses[-1]:.6f}", flush=True)
        if stop is not None and stop.requested and step < args.iters:
            _save(args, loader, step, dataset, model, optimiser, losses)
            raise Stopped(step)
    seconds = time.perf_counter() - start
    done = max(1, args.iters - first)
    return TrainReport(loader, done, seconds, wait, losses[0], losses[-1], losses, first)


def _channels(text: str) -> list[int]:
    try:
        got = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        got = []
    if len(got) < 2:
        raise typer.BadParameter(f"{text!r}: give at least two channel counts, e.g. 16,32,64,128")
    return got


def _joined_channels(argv: list[str]) -> list[str]:
    """`--channels 16 32 64` (the earlier form, still in job scripts) as `--channels 16,32,64`."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        out.append(argv[i])
        if argv[i] == "--channels":
            j = i + 1
            while j < len(argv) and not argv[j].startswith("-"):
                j += 1
            out.append(",".join(argv[i + 1 : j]))
            i = j
        else:
            i += 1
    return out


def parse(argv: list[str] | None = None) -> Args:
    """Command-line options (typer; exits 2 with the usage on bad input)."""
    got: list[Args] = []

    def command(
        cache: Annotated[Path, typer.Option(exists=True, file_okay=False, help="prepared cache (prep cache)")],
        pipeline: Annotated[
            Path | None,
            typer.Option(help="PIPELINE.py (default: the demo one, if the cache was made with it)"),
        ] = None,
        loader: Annotated[
            Loader,
            typer.Option(
                help="fast: PreparedLoader; drop-in: PreparedPersistentDataset; "
                "persistent: MONAI's; all: one after the other (blockprep, both: the same as fast, all)"
            ),
        ] = Loader.fast,
        backend: Annotated[str, typer.Option(help="blockprep backend: auto, posix, direct, blockdev, kvikio")] = "auto",
        gpu_budget: Annotated[str, typer.Option(help="bytes of items the fast path keeps on the GPU (8GiB)")] = "0",
        persistent_dir: Annotated[Path | None, typer.Option(help="PersistentDataset cache_dir")] = None,
        iters: Annotated[int, typer.Option(min=1, help="training steps per loader")] = 20,
        batchsize: Annotated[int, typer.Option(min=1, help="items per batch (each gives the tail's crops)")] = 2,
        workers: Annotated[int, typer.Option(min=0, help="DataLoader worker processes")] = 2,
        device: Annotated[str, typer.Option(help="cpu or cuda:N")] = "cpu",
        amp: Annotated[bool, typer.Option(help="mixed precision on GPU")] = True,
        channels: Annotated[str, typer.Option(help="UNet channels per level, comma-separated")] = "16,32,64,128",
        lr: Annotated[float, typer.Option(help="Adam learning rate")] = 1e-3,
        seed: Annotated[int, typer.Option(help="seed for weights, shuffling and the random tail")] = 0,
        json: Annotated[Path | None, typer.Option(help="also write the reports here")] = None,
        checkpoint: Annotated[
            Path | None,
            typer.Option(help="resume from this file if it exists; on SIGUSR1 save it at the next step and exit 3"),
        ] = None,
        log_every: Annotated[int, typer.Option(min=0, help="print the loss every N steps (0: never)")] = 0,
    ) -> None:
        name = OLD_NAMES.get(loader.value, loader.value)
        if checkpoint is not None and name == "all":
            raise typer.BadParameter("--checkpoint resumes one loader: choose fast, drop-in or persistent")
        got.append(Args(cache, pipeline, name, backend, gpu_budget, persistent_dir, iters, batchsize, workers, device,
                        amp, _channels(channels), lr, seed, json, checkpoint, log_every))  # fmt: skip

    app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)
    app.command(help=__doc__)(command)
    try:
        app(_joined_channels(sys.argv[1:] if argv is None else argv), prog_name="python -m workflows.train_seg3d")
    except SystemExit as exc:
        if exc.code or not got:
            raise
    return got[0]


def main(argv: list[str] | None = None) -> list[TrainReport]:
    """Train with the chosen loader(s) and print the share of step time spent waiting for data."""
    from loaders.errors import PrepError
    from workflows.resume import REQUEUE_EXIT, StopRequest

    args = parse(argv)
    stop = StopRequest() if args.checkpoint is not None else None  # before the imports: SIGUSR1 would kill
    try:
        args.pipeline = choose_pipeline(args.cache, args.pipeline)
        loaders = ["fast", "drop-in", "persistent"] if args.loader == "all" else [args.loader]
        reports = []
        for loader in loaders:
            report = train(args, loader, stop)
            print(report.line(), flush=True)
            reports.append(report)
    except (PrepError, ValueError) as exc:  # ValueError: a checkpoint of other settings (workflows.resume.load)
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    except Stopped:
        raise SystemExit(REQUEUE_EXIT) from None
    finally:
        if stop is not None:
            stop.close()
    base = next((r for r in reports if r.loader == "persistent"), None)
    for r in reports:
        if base is not None and r is not base and base.seconds > 0:
            print(f"{r.loader} steps take {r.seconds / base.seconds:.2f}x the time of PersistentDataset's")
    if args.json is not None:
        args.json.write_text(json.dumps([{**asdict(r), "wait_share": r.wait_share} for r in reports], indent=1))
    return reports


if __name__ == "__main__":
    main()
