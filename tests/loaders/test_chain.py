"""loaders.chain: the head/tail split and fingerprint shared by prep and the training-time loaders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from monai.transforms import (
    Compose,
    EnsureChannelFirstd,
    LoadImaged,
    RandFlipd,
    RandGaussianNoised,
    ScaleIntensityd,
    Spacingd,
)

from loaders import chain


def _chain(pixdim: float = 1.0) -> Compose:
    return Compose(
        [
            LoadImaged(keys=["image"]),
            Compose([EnsureChannelFirstd(keys=["image"]), Spacingd(keys=["image"], pixdim=(pixdim,) * 3)]),
            RandFlipd(keys=["image"], prob=0.5),
            ScaleIntensityd(keys=["image"]),  # after the first random transform: tail, although deterministic
        ]
    )


def test_split_at_first_randomizable_flattening_nested_composes() -> None:
    head, tail = chain.split(_chain())
    assert [type(t).__name__ for t in head] == ["LoadImaged", "EnsureChannelFirstd", "Spacingd"]
    assert [type(t).__name__ for t in tail] == ["RandFlipd", "ScaleIntensityd"]
    head2, tail2 = chain.split(list(_chain().transforms))
    assert len(head2) == 3 and len(tail2) == 2
    all_head, no_tail = chain.split([ScaleIntensityd(keys=["image"])])
    assert len(all_head) == 1 and no_tail == []


def test_fingerprint_is_stable_and_sensitive() -> None:
    head = chain.split(_chain())[0]
    assert chain.fingerprint(head) == chain.fingerprint(chain.split(_chain())[0])
    assert chain.fingerprint(head) != chain.fingerprint(chain.split(_chain(1.5))[0])
    assert chain.fingerprint(head) != chain.fingerprint(head[:2])
    assert len(chain.fingerprint(head)) == 64


def test_fingerprint_ignores_random_state() -> None:
    a, b = RandGaussianNoised(keys=["x"], prob=1.0), RandGaussianNoised(keys=["x"], prob=1.0)
    a.set_random_state(1)
    b.set_random_state(2)
    assert chain.fingerprint([a]) == chain.fingerprint([b])


@pytest.mark.slow
def test_fingerprint_same_in_another_process() -> None:
    code = (
        "from monai.transforms import LoadImaged, EnsureChannelFirstd, Spacingd\n"
        "from loaders import chain\n"
        "print(chain.fingerprint([LoadImaged(keys=['image']), EnsureChannelFirstd(keys=['image']),"
        " Spacingd(keys=['image'], pixdim=(1.0, 1.0, 1.0))]))\n"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    head = [
        LoadImaged(keys=["image"]),
        EnsureChannelFirstd(keys=["image"]),
        Spacingd(keys=["image"], pixdim=(1.0,) * 3),
    ]
    assert other == chain.fingerprint(head)


def test_describe() -> None:
    assert chain.describe(chain.split(_chain())[1]) == [
        "RandFlipd(keys=('image',))",
        "ScaleIntensityd(keys=('image',))",
    ]


def test_import_is_light() -> None:
    code = "import sys, loaders.chain; print(sorted(m for m in ('monai', 'torch', 'dask') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_user_code_fingerprint_ignores_module_name(tmp_path: Path) -> None:
    """prep runs PIPELINE.py under a generated module name; training imports it by its own: same fingerprint."""
    import runpy

    code = (
        "from monai.transforms import Compose, MapTransform, LoadImaged\n"
        "class Double(MapTransform):\n"
        "    def __call__(self, d):\n"
        "        return {k: v * 2 for k, v in d.items()}\n"
        "def ident(d):\n"
        "    return d\n"
        "transform = Compose([LoadImaged(keys=['image']), Double(keys=['image']), ident])\n"
    )
    path = tmp_path / "my_pipeline.py"
    path.write_text(code)
    a = runpy.run_path(str(path), run_name="blockprep_pipeline_x")["transform"]
    b = runpy.run_path(str(path), run_name="my_pipeline")["transform"]
    assert chain.fingerprint(chain.split(a)[0]) == chain.fingerprint(chain.split(b)[0])
    edited = tmp_path / "my_pipeline_edited.py"  # a new file: linecache would serve the old text of `path`
    edited.write_text(code.replace("v * 2", "v * 3"))
    c = runpy.run_path(str(edited), run_name="my_pipeline")["transform"]
    assert chain.fingerprint(chain.split(c)[0]) != chain.fingerprint(chain.split(b)[0])
