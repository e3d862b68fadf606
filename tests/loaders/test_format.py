from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loaders.cache import dtypes, nesting, spec, writing
from loaders.cache import format as fmt
from loaders.errors import ChecksumError, FormatError, IncompleteCacheError, SchemaVersionError


def write_small_cache(root: Path, arrays: list[dict[str, np.ndarray]]) -> None:
    writing.write_items(root, arrays, [{"source": {"i": i}} for i in range(len(arrays))])


def test_roundtrip_aligned(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    arrays = [
        {
            "image": rng.random((3, 5, 7), dtype=np.float32),
            "label": np.arange(10, dtype=np.uint8),
            "crops": [np.ones(2, np.int16)],
        }
        for _ in range(3)
    ]
    write_small_cache(tmp_path / "c", arrays)
    cache = fmt.PreparedCache(tmp_path / "c")
    assert len(cache) == 3
    for i, item in enumerate(arrays):
        entries = {e.key: e for e in cache.entries(i)}
        assert set(entries) == {"image", "label", "crops/0"}
        flat = nesting.flatten(item)
        for k, e in entries.items():
            assert e.offset % spec.ALIGN == 0
            raw = np.fromfile(e.shard, dtype=np.uint8, count=e.nbytes, offset=e.offset)
            fmt.check(e, raw)
            assert np.array_equal(raw.view(e.dtype).reshape(e.shape), flat[k])
        assert cache.meta(i)["source"] == {"i": i}
    assert (tmp_path / "c" / spec.SHARD_DIR / "shard-000000.bin").stat().st_size % spec.ALIGN == 0


def test_checksum_mismatch(tmp_path: Path) -> None:
    write_small_cache(tmp_path / "c", [{"x": np.ones(100, np.float32)}])
    e = fmt.PreparedCache(tmp_path / "c").entries(0)[0]
    raw = np.fromfile(e.shard, dtype=np.uint8, count=e.nbytes, offset=e.offset)
    raw[3] ^= 1
    with pytest.raises(ChecksumError, match="item 0 key 'x'"):
        fmt.check(e, raw)


def test_incomplete_and_future(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()
    with pytest.raises(FormatError, match="not a prepared cache"):
        fmt.PreparedCache(tmp_path / "c")
    (tmp_path / "c" / spec.JOURNAL_DIR).mkdir()  # what an interrupted `prep cache` leaves
    with pytest.raises(IncompleteCacheError, match="re-run"):
        fmt.PreparedCache(tmp_path / "c")
    write_small_cache(tmp_path / "d", [{"x": np.ones(3, np.float32)}])
    doc = json.loads((tmp_path / "d" / spec.MANIFEST).read_text())
    doc["schema_version"] = "9.0"
    (tmp_path / "d" / spec.MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(SchemaVersionError, match="9.0"):
        fmt.PreparedCache(tmp_path / "d")


@pytest.mark.parametrize("dtype", [">f4", "c8", "V2", [("r", "u1"), ("g", "u1")]])
def test_unsupported_dtypes(dtype: object) -> None:
    with pytest.raises(FormatError):
        dtypes.dtype_code(np.dtype(dtype))  # type: ignore[call-overload]  # a plain void is no bfloat16


def test_bfloat16_round_trips_through_a_cache_bit_for_bit(tmp_path: Path) -> None:
    """numpy has no bfloat16: it is written as its 2-byte pattern (`dtypes.BFLOAT16`) and viewed back as
    torch.bfloat16, every value (NaN, inf, subnormals) bit for bit; its index row names "bfloat16"."""
    import torch

    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)  # every bfloat16 bit pattern
    x = bits.view(torch.bfloat16).reshape(4, 128, 128)
    array = dtypes.to_numpy(x)
    assert array.dtype == dtypes.BFLOAT16 and dtypes.dtype_name(array.dtype) == "bfloat16"
    assert torch.equal(dtypes.to_tensor(array).view(torch.int16), bits.reshape(4, 128, 128))
    write_small_cache(tmp_path / "c", [{"image": x, "label": np.ones(3, np.uint8)}])
    cache = fmt.PreparedCache(tmp_path / "c")
    e = {e.key: e for e in cache.entries(0)}["image"]
    assert dtypes.dtype_name(e.dtype) == "bfloat16" and dtypes.torch_dtype(e.dtype) == torch.bfloat16
    raw = np.fromfile(e.shard, dtype=np.uint8, count=e.nbytes, offset=e.offset)
    fmt.check(e, raw)
    assert torch.equal(
        torch.from_numpy(raw).view(torch.bfloat16).reshape(e.shape).view(torch.int16), bits.view(4, 128, 128)
    )


def test_bfloat16_tensors_in_meta_keep_their_dtype() -> None:
    import torch

    from loaders.cache import meta

    x = torch.tensor([1.5, -0.0078125, 3.0e38], dtype=torch.bfloat16)
    got = meta.decode(json.loads(json.dumps(meta.encode({"t": x}))))["t"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, x)


leaves = st.integers()
nested = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, min_size=1, max_size=3)
        | st.dictionaries(st.text("abc", min_size=1, max_size=3), children, min_size=1, max_size=3)
    ),
    max_leaves=10,
)


@given(st.dictionaries(st.text("xyz", min_size=1, max_size=3), nested, min_size=1, max_size=3))
def test_flatten_roundtrip(obj: dict) -> None:  # type: ignore[type-arg]
    assert nesting.unflatten(nesting.flatten(obj)) == obj


@settings(max_examples=50)
@given(sizes=st.lists(st.integers(0, 20000), min_size=1, max_size=12))
def test_every_tensor_aligned_and_disjoint(sizes: list[int], tmp_path_factory: pytest.TempPathFactory) -> None:
    path = tmp_path_factory.mktemp("shard") / "s.bin"
    spans = []
    with writing.ShardWriter(path, prealloc=8192) as w:
        for n in sizes:
            off, nb, _ = w.write(np.zeros(n, np.uint8))
            assert off % spec.ALIGN == 0 and nb == n
            spans.append((off, off + spec.align_up(n)))
    for (_, a1), (b0, _) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert path.stat().st_size == spans[-1][1]


def test_meta_lines_of_parsed_journal_records_equal_those_of_the_original_metas(tmp_path: Path) -> None:
    """commit writes the journal's parsed metas as they are (`parsed=True`): the same bytes as converting the
    original metas (numpy arrays and scalars, tuples, nested lists, NaN, non-ASCII text, int keys)."""
    metas = [
        {"affine": np.eye(4) * 1.5, "spacing": (np.float32(0.8), 1.0), "n": np.int64(7), "ok": np.bool_(True),
         "nested": {"a": [np.arange(3), {"b": float("nan")}], 3: "drei"}, "name": "Milz ü", "none": None},
        {},
    ]  # fmt: skip
    parsed = [json.loads(json.dumps(nesting.to_jsonable(m))) for m in metas]
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    writing.write_meta(tmp_path / "a", metas)
    writing.write_meta(tmp_path / "b", parsed, parsed=True)
    for name in (spec.META, spec.META_OFFSETS):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
