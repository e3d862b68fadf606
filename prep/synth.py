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


def nifti_dataset(
    out: Path, count: int, size: int, seed: int = 0, progress: Progress | None = None, force: bool = False
) -> Path:
    """Write `count` image/label .nii.gz pairs of `size`^3 voxels and a decathlon datalist; return its path.

    An existing dataset in `out` is refused (UsageError), or replaced with `force`."""
    import nibabel as nib

    if count < 1:
        raise UsageError(f"--count must be at least 1 (got {count})")
    if size < 8:
        raise UsageError(f"--size must be at least 8 voxels (got {size})")
    out = Path(out)
    check_output_dir(out)
    refuse_overwrite(out, [out / "dataset.json", out / "imagesTr", out / "labelsTr"], force)
    (out / "imagesTr").mkdir(exist_ok=True)
    (out / "labelsTr").mkdir(exist_ok=True)
    training = []
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        image, label = sphere_volume(size, rng)
        spacing = rng.choice([0.8, 1.0, 1.5], 3)
        affine = np.diag([*spacing, 1.0])
        name = f"case_{i:05d}.nii.gz"
        nib.save(nib.Nifti1Image(image, affine), out / "imagesTr" / name)
        nib.save(nib.Nifti1Image(label, affine), out / "labelsTr" / name)
        training.append({"image": f"imagesTr/{name}", "label": f"labelsTr/{name}"})
        if progress:
            progress(1)
    datalist = out / "dataset.json"
    doc = {"name": "blockprep-synthetic", "numTraining": count, "training": training}
    datalist.write_text(json.dumps(doc, indent=1))
    return datalist


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
