"""How many bytes an input file declares it decodes to, read from its header alone, and the bound
`prep cache --max-item-bytes` sets on it.

A header is a claim: a 13 MB `.nii.gz` may declare 14 GB of voxels. The size is computed from the header
(NIfTI through nibabel, PNG/JPEG/TIFF through PIL without decoding, .npy/.npz from their array headers,
NRRD and MetaImage from their text headers) and compared with the bound before anything is decoded.
"""

from __future__ import annotations

import math
import os
import re
import warnings
import zipfile
from collections.abc import Iterable
from typing import IO, Any

from loaders.args import parse_bytes
from prep.errors import UsageError

_TEXT_HEADER_MAX = 1 << 16  # NRRD / MetaImage headers are a few hundred bytes; read no further than this
# NRRD "type:" and MetaImage "ElementType" values -> bytes per sample
_NRRD_NAMES = {
    1: "signed char|int8|int8_t|uchar|unsigned char|uint8|uint8_t",
    2: "short|short int|signed short|int16|int16_t|ushort|unsigned short|uint16|uint16_t",
    4: "int|signed int|int32|int32_t|uint|unsigned int|uint32|uint32_t|float",
    8: "longlong|long long|int64|int64_t|ulonglong|unsigned long long|uint64|uint64_t|double",
}
_NRRD_TYPES = {name: size for size, names in _NRRD_NAMES.items() for name in names.split("|")}
_MET_TYPES = {"MET_CHAR": 1, "MET_UCHAR": 1, "MET_SHORT": 2, "MET_USHORT": 2, "MET_INT": 4, "MET_UINT": 4,
              "MET_LONG": 8, "MET_ULONG": 8, "MET_LONG_LONG": 8, "MET_ULONG_LONG": 8, "MET_FLOAT": 4,
              "MET_DOUBLE": 8}  # fmt: skip
_PIL_BYTES = {"I;16": 2, "I;16L": 2, "I;16B": 2, "I;16N": 2, "I": 4, "F": 4}


def parse_size(text: str, name: str = "--max-item-bytes") -> int:
    """Bytes from '8G', '512MiB', '4096' (loaders.args.parse_bytes: G = 10^9, GiB = 2^30), at least 1."""
    value = parse_bytes(text, name)
    if value < 1:
        raise UsageError(f"{name} {text!r} must be at least 1 byte")
    return value


def human(n: int) -> str:
    """'13.8 GB'-style size (powers of 1000, as the issue and `df -H` write them)."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def default_max_item_bytes(available: int) -> int:
    """A quarter of the available memory: the decoded item, the head's copies of it (a float32 conversion
    is 4x a uint8 image) and the other workers' items must fit beside it. At least 64 MiB."""
    return max(available // 4, 64 << 20)


def declared(path: str | os.PathLike[str]) -> tuple[int, str] | None:
    """(bytes, what the header says, e.g. '512x512x300 int16') for a file whose kind has a cheap header;
    None for other kinds. Raises what the header parsers raise on a damaged header."""
    name = str(path).lower()
    if name.endswith((".nii", ".nii.gz")):
        return _nifti(path)
    if name.endswith((".png", ".jpg", ".jpeg", ".tif", ".tiff")):
        return _pil(path)
    if name.endswith(".npy"):
        with open(path, "rb") as f:
            return _npy(f)
    if name.endswith(".npz"):
        return _npz(path)
    if name.endswith(".nrrd"):
        return _text_header(path, r"^sizes:\s*(.+)$", r"^type:\s*(.+)$", _NRRD_TYPES, ":")
    if name.endswith((".mha", ".mhd")):
        return _text_header(path, r"^DimSize\s*=\s*(.+)$", r"^ElementType\s*=\s*(\S+)", _MET_TYPES, "=")
    return None


def declared_total(paths: Iterable[str]) -> int | None:
    """Decoded bytes an item's input files declare in their headers, together (None where one says nothing
    or its header cannot be read: that item's own checks say why)."""
    total = 0
    for path in paths:
        try:
            found = declared(path)
        except Exception:  # many parsers, many kinds of damage
            found = None
        if found is None:
            return None
        total += found[0]
    return total or None


def _describe(shape: tuple[int, ...] | list[int], dtype: str, itemsize: int) -> tuple[int, str]:
    dims = [int(d) for d in shape]
    return math.prod(dims) * itemsize, f"{'x'.join(map(str, dims)) or 'scalar'} {dtype}"


def _nifti(path: str | os.PathLike[str]) -> tuple[int, str]:
    import nibabel as nib

    header: Any = nib.load(path).header  # reads the header only; the voxels stay on disk
    dtype = header.get_data_dtype()
    return _describe(header.get_data_shape(), str(dtype), dtype.itemsize)


def _pil(path: str | os.PathLike[str]) -> tuple[int, str]:
    from PIL import Image

    with warnings.catch_warnings():  # our bound is the one said; PIL's warning would only repeat it
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(path) as image:  # parses the header; pixels are decoded only on load()
            width, height = image.size
            bands = len(image.getbands())
            frames = int(getattr(image, "n_frames", 1))
            mode = image.mode
    shape = [frames, height, width, bands] if frames > 1 else [height, width, bands]
    return _describe(shape, f"{mode} pixels", _PIL_BYTES.get(mode, 1))


def _npy(f: IO[bytes]) -> tuple[int, str]:
    import numpy as np

    version = np.lib.format.read_magic(f)
    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = reader(f, max_header_size=10000)
    return _describe(shape, str(dtype), dtype.itemsize)


def _npz(path: str | os.PathLike[str]) -> tuple[int, str]:
    total, parts = 0, []
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            if info.filename.endswith(".npy"):
                with archive.open(info) as f:
                    n, what = _npy(f)  # type: ignore[arg-type]
                total += n
                parts.append(what)
    return total, " + ".join(parts[:4]) + (f" + {len(parts) - 4} more" if len(parts) > 4 else "")


def _text_header(
    path: str | os.PathLike[str], sizes: str, kind: str, types: dict[str, int], sep: str
) -> tuple[int, str] | None:
    """NRRD or MetaImage: the dimension and sample-type lines of the text header (None if either is absent)."""
    with open(path, "rb") as f:
        text = f.read(_TEXT_HEADER_MAX).decode("latin-1")
    dims = re.search(sizes, text, re.MULTILINE | re.IGNORECASE)
    sample = re.search(kind, text, re.MULTILINE | re.IGNORECASE)
    if dims is None or sample is None:
        return None
    type_name = sample.group(1).strip()
    itemsize = types.get(type_name.lower() if sep == ":" else type_name.upper(), 8)
    channels = re.search(r"^ElementNumberOfChannels\s*=\s*(\d+)", text, re.MULTILINE)
    shape = [int(d) for d in dims.group(1).split()] + ([int(channels.group(1))] if channels else [])
    return _describe(shape, type_name, itemsize)
