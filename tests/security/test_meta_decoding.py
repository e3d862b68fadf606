"""Meta lines are decoded from an allow-list of types: nothing a cache names is imported or called, nothing
unbounded is allocated, and every refusal is one line (FormatError)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from craft import copy_cache, rewrite_meta
from typer.testing import CliRunner

from loaders import FormatError, PreparedDataset
from loaders.cache.meta import decode
from prep.cli import app

pytest.importorskip("monai")


def _plant(line: dict, value: object) -> dict:
    line["values"] = {**(line.get("values") or {}), "planted": value}
    line["typed"] = 1
    return line


def test_an_enum_tag_naming_a_function_runs_nothing(good_cache: Path, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    cache = copy_cache(good_cache, tmp_path / "c")
    attack = {"__enum__": "monai.utils.misc:os.system", "v": f"touch {marker}"}
    rewrite_meta(cache, lambda i, line: _plant(line, attack))
    ds = PreparedDataset(cache, meta=False)
    with pytest.raises(FormatError, match="is not a class of monai.utils.enums"):
        ds[0]  # refused, never decoded to a string nor called
    assert not marker.exists()
    for name in ("os:system", "monai.utils.enums:os.system", "monai.utils.enums:_private", "builtins:eval", 5):
        with pytest.raises(FormatError, match="enum tag"):
            decode({"__enum__": name, "v": "x"})


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"__enum__": "monai.utils.enums:SpaceKeys", "v": "XYZ"}, "is not a member of SpaceKeys"),
        ({"__enum__": "monai.utils.enums:NoSuchEnum", "v": "RAS"}, "is not an enum of"),
        ({"__enum__": "monai.utils.enums:annotations", "v": "RAS"}, "is not an enum of"),
    ],
)
def test_unknown_enum_classes_and_members_are_refused(good_cache: Path, tmp_path: Path, doc: dict, says: str) -> None:
    with pytest.raises(FormatError, match=says):
        decode(doc)
    cache = copy_cache(good_cache, tmp_path / "c")
    rewrite_meta(cache, lambda i, line: _plant(line, doc))
    with pytest.raises(FormatError, match=says):
        PreparedDataset(cache, meta=False)[0]
    result = CliRunner().invoke(app, ["verify", str(cache)])
    assert result.exit_code == 1 and says in result.output, result.output


def test_monai_enums_still_come_back() -> None:
    from monai.utils.enums import SpaceKeys

    assert decode({"__enum__": "monai.utils.enums:SpaceKeys", "v": "RAS"}) is SpaceKeys.RAS


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        ({"__nd__": "<U100000000", "s": [1], "v": ["a"]}, "not a numeric dtype"),
        ({"__nd__": "(100000000,)f8", "s": [1], "v": [1]}, "not a numeric dtype"),
        ({"__nd__": "O", "s": [1], "v": [1]}, "not a numeric dtype"),
        ({"__nd__": "float32", "s": [2**32, 2**32], "v": [1.0]}, "does not hold"),
        ({"__nd__": "float32", "s": [-1], "v": [1.0]}, "not a list of sizes"),
        ({"__pt__": "float32", "s": [3], "v": [1.0]}, "does not hold"),
        ({"__np__": "V8", "v": 1}, "not a numeric dtype"),
        ({"__tuple__": "abc"}, "holds no list"),
        ({"__np__": "int8", "v": 1000}, "does not fit int8"),
        ({"__np__": "uint8", "v": -1}, "does not fit uint8"),
    ],
)
def test_tags_are_bounded(doc: dict, says: str) -> None:
    with pytest.raises(FormatError, match=says):
        decode(doc)


def test_deep_nesting_is_one_line(good_cache: Path, tmp_path: Path) -> None:
    deep: object = 1
    for _ in range(100):
        deep = [deep]
    with pytest.raises(FormatError, match="nested deeper"):
        decode(deep)
    cache = copy_cache(good_cache, tmp_path / "c")
    rewrite_meta(cache, lambda i, line: json.dumps(line)[:-1] + ', "x": ' + "[" * 100000 + "]" * 100000 + "}")
    with pytest.raises(FormatError, match="not valid JSON"):
        PreparedDataset(cache)[0]
