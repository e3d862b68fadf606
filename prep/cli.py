"""The `prep` command: thin option parsing over library functions; PrepError becomes a one-line exit 1.

Each command group keeps its options here and its work in its own module (synth, bmap, cache).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer

from prep.errors import PrepError

T = TypeVar("T")

app = typer.Typer(
    help="blockprep: block maps, prepared caches and fast loaders for GPU training.\n\n"
    "Example: prep synth nifti data/ --count 8 --size 64",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
synth_app = typer.Typer(
    help="Make synthetic datasets for demos and tests.\n\nExample: prep synth nifti data/ --count 8",
    no_args_is_help=True,
)
app.add_typer(synth_app, name="synth")


def fail(message: str) -> typer.Exit:
    """Print a one-line error to stderr and return the Exit(1) to raise."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(1)


def guarded(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call a library function; PrepError and Ctrl-C become a one-line message and a non-zero exit."""
    try:
        return fn(*args, **kwargs)
    except PrepError as exc:
        raise fail(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    except KeyboardInterrupt:
        typer.echo("interrupted: finished work is kept; run the same command again to resume", err=True)
        raise typer.Exit(130) from None


@contextmanager
def progress_bar(total: int | None, desc: str, unit: str = "it") -> Iterator[Callable[[int], None]]:
    """A tqdm bar on stderr (silent when stderr is not a terminal and total is small)."""
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True, leave=False, disable=None) as bar:

        def update(n: int) -> None:
            bar.update(n)

        yield update


@synth_app.command("nifti")
def synth_nifti(
    out: Annotated[Path, typer.Argument(help="Output folder (its parent must exist).")],
    count: Annotated[int, typer.Option(help="Number of image/label pairs.")] = 8,
    size: Annotated[int, typer.Option(help="Edge length of each cubic volume, in voxels.")] = 64,
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same files.")] = 0,
) -> None:
    """3D image/label NIfTI pairs (.nii.gz) of random spheres, plus a decathlon-style dataset.json.

    Example: prep synth nifti data/spheres --count 16 --size 96 --seed 1
    """
    from prep import synth

    with progress_bar(count, "synth nifti", "pair") as update:
        datalist = guarded(synth.nifti_dataset, out, count, size, seed, progress=update)
    typer.echo(f"wrote {count} image/label pairs of {size}^3 voxels; datalist: {datalist}")


@synth_app.command("images")
def synth_images(
    out: Annotated[Path, typer.Argument(help="Output folder (its parent must exist).")],
    classes: Annotated[int, typer.Option(help="Number of class folders.")] = 4,
    per_class: Annotated[int, typer.Option(help="JPEG files per class.")] = 16,
    size: Annotated[int, typer.Option(help="Edge length of each square image, in pixels.")] = 64,
    seed: Annotated[int, typer.Option(help="Random seed; the same seed gives the same files.")] = 0,
) -> None:
    """An ImageNet-style class-folder JPEG tree: OUT/train/<class>/<file>.JPEG.

    Example: prep synth images data/imgs --classes 10 --per-class 100
    """
    from prep import synth

    with progress_bar(classes * per_class, "synth images", "file") as update:
        train = guarded(synth.image_tree, out, classes, per_class, size, seed, progress=update)
    typer.echo(f"wrote {classes * per_class} JPEG files in {classes} classes under {train}")


# --- bmap commands (work in prep/bmap.py) ---

# --- cache and verify commands (work in prep/cache.py) ---


def main() -> None:
    """Entry point for `python -m prep`."""
    app()
