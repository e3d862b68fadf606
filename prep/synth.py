"""Synthetic datasets for demos and tests: 3D NIfTI image/label pairs and class-folder JPEG trees.

Deterministic for a seed: item i of a dataset depends only on (seed, i), so a dataset can be extended.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np

from prep.errors import UsageError

Progress = Callable[[int], None]


def refuse_overwrite(out: Path, existing: list[Path], force: bool) -> None:
    """Refuse to write over an earlier dataset (its files would be orphaned or mixed, caches of it go stale);
    with `force`, remove it first."""
    present = [p for p in existing if p.exists()]
    if not present:
        return
    if not force:
        raise UsageError(
            f"{out}: already holds a dataset ({', '.join(p.name for p in present)}); pass --force to replace it, "
            "or choose another folder"
        )
    for path in present:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def check_output_dir(out: Path) -> None:
    """Create `out` (its parent must exist) or raise a UsageError naming the fix."""
    out = Path(out)
    if not out.parent.exists():
        raise UsageError(f"{out}: parent directory {out.parent} does not exist; create it first")
    try:
        out.mkdir(exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{out}: cannot create ({exc.strerror}); choose a writable location") from exc
    if not os.access(out, os.W_OK):
        raise UsageError(f"{out}: not writable; choose a writable location")


def sphere_volume(size: int, rng: np.random.Generator, n_spheres: int = 3) -> tuple[np.ndarray, np.ndarray]:
    """A float32 image of noisy bright spheres on a dark background, and its uint8 label (sphere = 1)."""
    grid = np.indices((size, size, size), dtype=np.float32)
    label = np.zeros((size, size, size), dtype=np.uint8)
    for _ in range(n_spheres):
        centre = rng.uniform(0.2 * size, 0.8 * size, 3).astype(np.float32)
        radius = rng.uniform(0.08 * size, 0.2 * size)
        dist2 = sum((grid[d] - centre[d]) ** 2 for d in range(3))
        label[dist2 <= radius**2] = 1
    image = label.astype(np.float32) * 800.0 + rng.normal(100.0, 60.0, label.shape).astype(np.float32)
    return image, label


KINDS = ("spheres", "ct", "mr")


def ct_volume(shape: tuple[int, int, int], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A CT-like int16 volume in Hounsfield units (air -1000 around an ellipsoid body of soft tissue, an organ
    blob brighter than it) and its uint8 organ label."""
    grid = np.indices(shape, dtype=np.float32)
    centre = [(n - 1) / 2 for n in shape]
    body = sum(((grid[d] - centre[d]) / (0.49 * shape[d])) ** 2 for d in range(3)) <= 1.0
    organ_c = [c + rng.uniform(-0.15, 0.15) * n for c, n in zip(centre, shape)]
    organ_r = [rng.uniform(0.08, 0.16) * n for n in shape]
    organ = body & (sum(((grid[d] - organ_c[d]) / organ_r[d]) ** 2 for d in range(3)) <= 1.0)
    image = np.where(body, rng.normal(40.0, 20.0, shape), rng.normal(-1000.0, 10.0, shape))
    image[organ] = rng.normal(110.0, 15.0, int(organ.sum()))
    return image.astype(np.int16), organ.astype(np.uint8)


def mr_volume(shape: tuple[int, int, int], rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """A 4-channel MR-like float32 volume (X, Y, Z, 4: four contrasts of one head, zero outside it) and a tumour
    label in BraTS's classes (0 background, 1 necrosis, 2 oedema, 4 enhancing)."""
    grid = np.indices(shape, dtype=np.float32)
    centre = [(n - 1) / 2 for n in shape]
    head = sum(((grid[d] - centre[d]) / (0.42 * shape[d])) ** 2 for d in range(3)) <= 1.0
    tc = [c + rng.uniform(-0.12, 0.12) * n for c, n in zip(centre, shape)]
    dist = np.sqrt(sum(((grid[d] - tc[d]) / (0.2 * shape[d])) ** 2 for d in range(3)))
    label = np.zeros(shape, dtype=np.uint8)
    label[head & (dist <= 1.0)] = 2
    label[head & (dist <= 0.6)] = 4
    label[head & (dist <= 0.3)] = 1
    channels = []
    for c in range(4):
        base = rng.normal(300.0 + 100 * c, 40.0, shape) + 150.0 * (label > 0) * (c % 2 * 2 - 1)
        channels.append(np.where(head, np.clip(base, 1.0, None), 0.0))
    return np.stack(channels, axis=-1).astype(np.float32), label


def _item_geometry(
    rng: np.random.Generator, size: int, shape_range: float, spacing_range: tuple[float, float] | None
) -> tuple[tuple[int, int, int], np.ndarray]:
    """An item's shape (edges size x U(1 - r, 1 + r)) and voxel spacing (per axis U(lo, hi) mm)."""
    r = shape_range
    shape = tuple(max(8, int(round(size * rng.uniform(1 - r, 1 + r)))) for _ in range(3))
    spacing = rng.uniform(*spacing_range, 3) if spacing_range else rng.choice([0.8, 1.0, 1.5], 3)
    return shape, spacing  # type: ignore[return-value]


def nifti_dataset(
    out: Path,
    count: int,
    size: int,
    seed: int = 0,
    progress: Progress | None = None,
    force: bool = False,
    kind: str = "spheres",
    shape_range: float = 0.0,
    spacing_range: tuple[float, float] | None = None,
) -> Path:
    """Write `count` image/label .nii.gz pairs of about `size`^3 voxels and a decathlon datalist; return its path.

    kind: "spheres" (bright spheres, float32), "ct" (int16 Hounsfield units: air around a body, an organ
    label) or "mr" (4 float32 contrasts in the last dim, BraTS label classes 0/1/2/4). shape_range r: each
    edge of each volume is size x U(1 - r, 1 + r) (0: all size^3). spacing_range (lo, hi): each axis's voxel
    spacing in mm drawn from U(lo, hi) (None: 0.8, 1.0 or 1.5); for "ct" the slice axis's is 1.6 times that.
    An existing dataset in `out` is refused (UsageError), or replaced with `force`."""
    import nibabel as nib

    _check_nifti_args(count, size, kind, shape_range, spacing_range)
    out = Path(out)
    check_output_dir(out)
    refuse_overwrite(out, [out / "dataset.json", out / "imagesTr", out / "labelsTr"], force)
    (out / "imagesTr").mkdir(exist_ok=True)
    (out / "labelsTr").mkdir(exist_ok=True)
    training = []
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        if kind == "spheres" and not shape_range and spacing_range is None:  # the original datasets, unchanged
            image, label = sphere_volume(size, rng)
            spacing = rng.choice([0.8, 1.0, 1.5], 3)
        else:
            shape, spacing = _item_geometry(rng, size, shape_range, spacing_range)
            if kind == "ct":  # CT slices are thicker than the in-plane pixels
                spacing = spacing * np.array([1.0, 1.0, 1.6])
            make = {"spheres": lambda sh, g: sphere_volume(sh[0], g), "ct": ct_volume, "mr": mr_volume}[kind]
            image, label = make(shape if kind != "spheres" else (shape[0],) * 3, rng)
        affine = np.diag([*spacing, 1.0])
        name = f"case_{i:05d}.nii.gz"
        nib.save(nib.Nifti1Image(image, affine), out / "imagesTr" / name)
        nib.save(nib.Nifti1Image(label, affine), out / "labelsTr" / name)
        training.append({"image": f"imagesTr/{name}", "label": f"labelsTr/{name}"})
        if progress:
            progress(1)
    datalist = out / "dataset.json"
    doc = {"name": f"blockprep-synthetic-{kind}", "numTraining": count, "training": training}
    datalist.write_text(json.dumps(doc, indent=1))
    return datalist


def _check_nifti_args(
    count: int, size: int, kind: str, shape_range: float, spacing_range: tuple[float, float] | None
) -> None:
    if count < 1:
        raise UsageError(f"--count must be at least 1 (got {count})")
    if size < 8:
        raise UsageError(f"--size must be at least 8 voxels (got {size})")
    if kind not in KINDS:
        raise UsageError(f"--kind must be one of {', '.join(KINDS)} (got {kind!r})")
    if not 0.0 <= shape_range < 1.0:
        raise UsageError(f"--shape-range must be in [0, 1) (got {shape_range})")
    if spacing_range is not None and not 0 < spacing_range[0] <= spacing_range[1]:
        raise UsageError(f"--spacing-range must be two spacings 0 < LO <= HI in mm (got {spacing_range})")


def mednist_like(out: Path, count: int, size: int = 64, classes: int = 6, seed: int = 1) -> Path:
    """A MedNIST-like datalist: `count` grayscale `size`^2 JPEGs of noisy blobs, {"image": path, "label": class}."""
    from PIL import Image

    (out / "images").mkdir(parents=True, exist_ok=True)
    training = []
    grid = np.indices((size, size), dtype=np.float32)
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        label = i % classes
        centre = rng.uniform(0.3 * size, 0.7 * size, 2)
        blob = np.exp(-((grid[0] - centre[0]) ** 2 + (grid[1] - centre[1]) ** 2) / (2 * (4 + 3 * label) ** 2))
        pixels = np.clip(200 * blob + rng.normal(30, 15, (size, size)), 0, 255).astype(np.uint8)
        Image.fromarray(pixels, mode="L").save(out / "images" / f"{i:06d}.jpeg", quality=90)
        training.append({"image": f"images/{i:06d}.jpeg", "label": label})
    (out / "dataset.json").write_text(json.dumps({"training": training}))
    return out / "dataset.json"


def image_tree(
    out: Path,
    classes: int,
    per_class: int,
    size: int = 64,
    seed: int = 0,
    progress: Progress | None = None,
    force: bool = False,
) -> Path:
    """Write an ImageNet-style tree OUT/train/<class>/<class>_<i>.JPEG; return OUT/train.

    An existing OUT/train is refused (UsageError), or replaced with `force`."""
    from PIL import Image

    if classes < 1 or per_class < 1:
        raise UsageError(f"--classes and --per-class must be at least 1 (got {classes}, {per_class})")
    out = Path(out)
    check_output_dir(out)
    train = out / "train"
    refuse_overwrite(out, [train], force)
    for c in range(classes):
        cls_dir = train / f"n{c:08d}"
        cls_dir.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            rng = np.random.default_rng([seed, c, i])
            base = np.array([(37 * c) % 256, (91 * c) % 256, (151 * c) % 256], dtype=np.float32)
            pixels = np.clip(base + rng.normal(0, 40, (size, size, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(cls_dir / f"n{c:08d}_{i}.JPEG", quality=90)
            if progress:
                progress(1)
    return train
