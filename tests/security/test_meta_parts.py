"""Meta lines whose parts readers take apart: an affine that does not fit its
tensor, parts of the wrong kind, a null where a number belongs, non-tensor outputs that differ between items:
each one FormatError line in every reader and in `prep verify` (exit 1, no traceback); and a PreparedLoader
refuses to be pickled in one line."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
from cacheutil import SPHERES
from craft import copy_cache, rewrite_meta
from typer.testing import CliRunner

from loaders import FormatError, PreparedDataset
from loaders.cache.meta import check_affine
from loaders.errors import ArgumentError
from prep.cli import app

torch = pytest.importorskip("torch")
pytest.importorskip("monai")


def _verify_refuses(cache: Path, says: str) -> None:
    result = CliRunner().invoke(app, ["verify", str(cache)])
    assert result.exit_code == 1, result.output
    assert says in result.output and "Traceback" not in result.output, result.output


def _on_item0(change: Any) -> Any:
    def edit(i: int, line: dict[str, Any]) -> dict[str, Any]:
        if i == 0:
            change(line)
        return line

    return edit


def _affine(value: Any) -> Any:
    return _on_item0(lambda line: line["meta"]["image"].__setitem__("affine", value))


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ({"__pt__": "float64", "s": [2, 2], "v": [[1.0, 0.0], [0.0, 1.0]]}, "an affine of shape (2, 2) does not fit"),
        ({"__pt__": "float64", "s": [5, 5], "v": [[0.0] * 5] * 5}, "an affine of shape (5, 5) does not fit"),
        ({"__pt__": "float64", "s": [3, 4], "v": [[0.0] * 4] * 3}, "an affine of shape (3, 4) does not fit"),
        ("abc", "the affine is no matrix of numbers"),
        ({"__nd__": "float64", "s": [], "v": None}, "null is not a number"),
    ],
)
def test_an_affine_that_does_not_fit_is_refused(good_cache: Path, tmp_path: Path, value: Any, says: str) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    rewrite_meta(cache, _affine(value))
    with pytest.raises(FormatError, match=r"^meta: ") as info:
        PreparedDataset(cache)[0]
    assert says in str(info.value) and "\n" not in str(info.value)
    PreparedDataset(cache)[1]  # the other items are sound
    _verify_refuses(cache, says)


def test_affines_monai_gives_are_accepted() -> None:
    """4x4 for 2-D images with or without a channel, 3x3 after a squeeze, 4x4 for a 1-D tensor (MetaTensor's
    default): what MONAI's own readers and transforms make."""
    eye = torch.eye
    for rows, ndim in ((4, 2), (4, 3), (4, 4), (3, 3), (3, 2), (4, 1), (2, 2), (4, 0)):
        assert check_affine(eye(rows), ndim).shape == (rows, rows)
    with pytest.raises(FormatError, match=r"\(3, 3\) does not fit a 4-D tensor"):
        check_affine(eye(3), 4)  # a 3-D volume with a channel has 3 spatial dimensions


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda line: line.__setitem__("meta", [1, 2]), "'meta' is a list, not an object"),
        (lambda line: line.__setitem__("values", "abc"), "'values' is a str, not an object"),
        (lambda line: line["meta"].__setitem__("image", 5), "'meta' of 'image' is a int, not a dict"),
        (lambda line: line["applied_operations"].__setitem__("image", "x"), "of 'image' is a str, not a list"),
        (lambda line: line["applied_operations"].__setitem__("image", [1]), "holds an operation that is not an"),
        (lambda line: line.__setitem__("kinds", {"image": "pickle"}), "'kinds' names a kind other than"),
        (lambda line: line.__setitem__("section", 5), "'section' is not a string"),
    ],
)
def test_parts_of_the_wrong_kind_are_one_line(good_cache: Path, tmp_path: Path, change: Any, says: str) -> None:
    cache = copy_cache(good_cache, tmp_path / "c")
    rewrite_meta(cache, _on_item0(change))
    for meta in (True, False):  # before any decoding: the line itself is refused
        with pytest.raises(FormatError, match="item 0's meta line is malformed") as info:
            PreparedDataset(cache, meta=meta)[0]
        assert says in str(info.value) and "\n" not in str(info.value)
    _verify_refuses(cache, says)


def _flips() -> Any:
    """The good cache's head with a tail that fits its volumes (no 32^3 crop)."""
    from monai.transforms import Compose, RandFlipd

    from prep.pipeline import load_pipeline

    return Compose([*load_pipeline(SPHERES).head, RandFlipd(keys=["image", "label"], prob=0.5)])


def test_non_tensor_outputs_that_differ_between_items(good_cache: Path, tmp_path: Path) -> None:
    """A value in item 0's line only: PreparedLoader refuses the first batch holding another item, in one
    line whatever the order (MONAI's collate raised KeyError only when a batch mixed them); verify lists it."""
    from loaders import PreparedLoader

    cache = copy_cache(good_cache, tmp_path / "c")
    rewrite_meta(cache, _on_item0(lambda line: line.__setitem__("values", {"cls": 3})))
    transform = _flips()
    for shuffle in (False, True):
        loader = PreparedLoader(cache, transform, 1, device="cpu", shuffle=shuffle, seed=1)  # shapes differ
        with pytest.raises(FormatError, match=r"item \d's non-tensor outputs \[\] differ from item 0's \['cls'\]"):
            list(loader)
    _verify_refuses(cache, "item 1 key 'cls': its non-tensor outputs differ from item 0's")


def test_a_loader_is_not_pickled(good_cache: Path) -> None:
    from loaders import PreparedLoader

    loader = PreparedLoader(good_cache, _flips(), 2, device="cpu")
    with pytest.raises(ArgumentError) as info:
        pickle.dumps(loader)
    assert isinstance(info.value, TypeError) and "cannot be pickled" in str(info.value)
    assert "build one in each process" in str(info.value)
