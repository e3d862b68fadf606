"""Image classification on a class-folder tree (ImageNet layout: ROOT/<class>/<image>), with DALI or PyTorch.

\b
    python -m workflows.train_classify2d demo/images/train --iters 100                  # DALI, CPU pipeline
    python -m workflows.train_classify2d demo/images/train --device cuda:0 --iters 500  # DALI, GPU decode
    python -m workflows.train_classify2d demo/images/train --reader blockprep --backend direct
    python -m workflows.train_classify2d demo/images/train --reader torch               # PIL + DataLoader

DALI: `fn.readers.file(file_root=...)` reads files and gives labels (the sorted class folders numbered from
0), or `--reader blockprep` reads the same files with the same labels through a blockprep backend
(`loaders.faces.dali.FileSource` into `fn.external_source`). `fn.decoders.image` decodes (on the GPU with
device="mixed"), then resize, random flip and normalise. PyTorch: the same labels, decoded by PIL in
DataLoader workers. A small CNN; the report gives the share of step time spent waiting for the next batch.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

MEAN = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STD = (0.229 * 255, 0.224 * 255, 0.225 * 255)


class Reader(str, Enum):
    """Who reads and decodes the images."""

    auto = "auto"
    dali = "dali"
    blockprep = "blockprep"
    torch = "torch"


@dataclass
class Args:
    """The command line's settings."""

    datadir: Path
    reader: str = "auto"
    backend: str = "auto"
    iters: int = 50
    batchsize: int = 32
    size: int = 64
    workers: int = 2
    device: str = "cpu"
    lr: float = 0.05
    seed: int = 0


@dataclass
class ClassifyReport:
    """What one run measured."""

    reader: str
    classes: int
    iters: int
    seconds: float
    wait_seconds: float
    first_loss: float
    last_loss: float

    @property
    def wait_share(self) -> float:
        """Fraction of step time spent waiting for data (0..1)."""
        return self.wait_seconds / self.seconds if self.seconds > 0 else 0.0


def class_tree(root: Path) -> tuple[list[str], list[int], list[str]]:
    """(files, labels, class names) in the order `fn.readers.file(file_root=root)` labels them."""
    classes = sorted(p.name for p in root.iterdir() if p.is_dir())
    files, labels = [], []
    for label, name in enumerate(classes):
        for f in sorted(os.listdir(root / name)):
            files.append(str(root / name / f))
            labels.append(label)
    if not files:
        raise SystemExit(f"error: {root}: no images in class subfolders (expected ROOT/<class>/<image>)")
    return files, labels, classes


def dali_batches(root: Path, args: Args) -> Iterator[tuple[Any, Any]]:
    """Endless (images NCHW float, labels) torch batches from a DALI pipeline (CPU, or GPU decode on cuda)."""
    from loaders.deps import require

    dali = require("nvidia.dali", "the DALI reader (or pass --reader torch)")
    plugin = require("nvidia.dali.plugin.pytorch", "the DALI reader (or pass --reader torch)")
    fn, types = dali.fn, dali.types
    gpu = args.device.startswith("cuda")
    source = None
    if args.reader == "blockprep":
        from loaders.faces.dali import FileSource

        source = FileSource(root, backend=args.backend, batch_size=args.batchsize, shuffle=True, seed=args.seed)

    @dali.pipeline_def(batch_size=args.batchsize, num_threads=max(2, os.cpu_count() or 2), seed=args.seed,
                  device_id=int(args.device.partition(":")[2] or 0) if gpu else None)  # fmt: skip
    def pipe() -> Any:
        if source is None:
            jpegs, labels = fn.readers.file(file_root=str(root), random_shuffle=True, name="reader")
        else:  # blockprep: the same files and labels, read through a backend (many requests in flight)
            jpegs, labels = fn.external_source(source=source, num_outputs=2, batch=True, cycle="raise")
        images = fn.decoders.image(jpegs, device="mixed" if gpu else "cpu", output_type=types.RGB)
        images = fn.resize(images, resize_x=args.size, resize_y=args.size)
        images = fn.crop_mirror_normalize(images, dtype=types.FLOAT, output_layout="CHW", mean=MEAN, std=STD,
                                          mirror=fn.random.coin_flip())  # fmt: skip
        return images, labels.gpu() if gpu else labels

    pipeline = pipe()
    pipeline.build()
    # epochs end where the reader says (reader_name), or where the external source raises StopIteration
    epoch = {"reader_name": "reader"} if source is None else {}
    it = plugin.DALIGenericIterator(pipeline, ["image", "label"], last_batch_policy=plugin.LastBatchPolicy.DROP,
                                    auto_reset=True, **epoch)  # fmt: skip
    while True:
        for out in it:
            yield out[0]["image"], out[0]["label"].reshape(-1).long()


class _TreeDataset:
    """PIL decoding of a class tree (the PyTorch path): (CHW float tensor, label)."""

    def __init__(self, files: list[str], labels: list[int], size: int) -> None:
        self.files, self.labels, self.size = files, labels, size

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        import numpy as np
        import torch
        from PIL import Image

        with Image.open(self.files[i]) as im:
            pixels = np.asarray(im.convert("RGB").resize((self.size, self.size)), dtype=np.float32)
        image = (pixels - np.array(MEAN, np.float32)) / np.array(STD, np.float32)
        if torch.rand(()) < 0.5:
            image = image[:, ::-1]
        return torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1))), self.labels[i]


def torch_batches(root: Path, args: Args) -> Iterator[tuple[Any, Any]]:
    """Endless shuffled (images, labels) batches decoded by PIL in DataLoader workers."""
    import torch

    files, labels, _ = class_tree(root)
    dataset: Any = _TreeDataset(files, labels, args.size)  # map-style: __len__ and __getitem__ suffice
    loader: Any = torch.utils.data.DataLoader(
        dataset, batch_size=args.batchsize, shuffle=True, drop_last=True, num_workers=args.workers,
        generator=torch.Generator().manual_seed(args.seed), persistent_workers=args.workers > 0,
    )  # fmt: skip
    while True:
        yield from loader


def small_cnn(classes: int) -> Any:
    """Three conv blocks and a linear head."""
    from torch import nn

    def block(cin: int, cout: int) -> list[Any]:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(inplace=True), nn.MaxPool2d(2)]

    return nn.Sequential(*block(3, 16), *block(16, 32), *block(32, 64), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, classes))  # fmt: skip


def pick_reader(name: str) -> str:
    """`auto`: DALI when it is installed, else PyTorch."""
    if name != "auto":
        return name
    from loaders.deps import has

    return "dali" if has("nvidia.dali") else "torch"


def train(args: Args) -> ClassifyReport:
    """Run `args.iters` steps; time in `next(batches)` (and the copy to the device) counts as waiting."""
    import torch

    torch.manual_seed(args.seed)
    reader = pick_reader(args.reader)
    root = Path(args.datadir)
    classes = len(class_tree(root)[2])
    batches = torch_batches(root, args) if reader == "torch" else dali_batches(root, args)
    model = small_cnn(classes).to(args.device)
    optimiser = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    losses: list[float] = []
    wait = 0.0
    start = time.perf_counter()
    for _ in range(args.iters):
        t0 = time.perf_counter()
        images, labels = next(batches)
        images, labels = images.to(args.device, non_blocking=True), labels.to(args.device, non_blocking=True)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize(args.device)
        wait += time.perf_counter() - t0
        optimiser.zero_grad(set_to_none=True)
        loss = loss_fn(model(images), labels)
        loss.backward()
        optimiser.step()
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - start
    return ClassifyReport(reader, classes, args.iters, seconds, wait, losses[0], losses[-1])


def parse(argv: list[str] | None = None) -> Args:
    """Command-line options (typer; exits 2 with the usage on bad input)."""
    got: list[Args] = []

    def command(
        datadir: Annotated[
            Path, typer.Argument(exists=True, file_okay=False, help="class-folder tree DATADIR/<class>/<image>")
        ],
        reader: Annotated[
            Reader, typer.Option(help="dali: fn.readers.file; blockprep: FileSource; torch: PIL")
        ] = Reader.auto,
        backend: Annotated[str, typer.Option(help="backend of --reader blockprep (auto, posix, direct, ...)")] = "auto",
        iters: Annotated[int, typer.Option(min=1, help="training steps")] = 50,
        batchsize: Annotated[int, typer.Option(min=1, help="images per batch")] = 32,
        size: Annotated[int, typer.Option(min=8, help="images are resized to SIZE x SIZE")] = 64,
        workers: Annotated[int, typer.Option(min=0, help="DataLoader workers (PyTorch reader)")] = 2,
        device: Annotated[str, typer.Option(help="cpu or cuda:N")] = "cpu",
        lr: Annotated[float, typer.Option(help="SGD learning rate")] = 0.05,
        seed: Annotated[int, typer.Option(help="seed for weights and shuffling")] = 0,
    ) -> None:
        got.append(Args(datadir, reader.value, backend, iters, batchsize, size, workers, device, lr, seed))

    app = typer.Typer(add_completion=False, rich_markup_mode=None, pretty_exceptions_enable=False)
    app.command(help=__doc__)(command)
    try:
        app(argv, prog_name="python -m workflows.train_classify2d")
    except SystemExit as exc:
        if exc.code or not got:
            raise
    return got[0]


def main(argv: list[str] | None = None) -> ClassifyReport:
    """Train and print one summary line."""
    r = train(parse(argv))
    print(f"{r.reader}: {r.classes} classes, {r.iters} steps in {r.seconds:.2f} s, waiting for data "
          f"{100 * r.wait_share:.1f}% of step time, loss {r.first_loss:.3f} -> {r.last_loss:.3f}")  # fmt: skip
    return r


if __name__ == "__main__":
    main()
