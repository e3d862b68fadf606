"""numpy's uniform numbers made on a CUDA device from a `RandomState`'s state: the same numbers, bit for bit, with no
host draw and no copy up.

`Rand3DElasticd` draws three uniform numbers a voxel of its grid (2.65 M an item at 96^3: 28 ms of numpy on a GPU
box's core, then 10.6 MB copied up). Its draw can be described instead (`Deferring`): the generator's state where
the numbers begin (a 624-word key and a position: 2.5 KB) and their count, range and shape (`Uniforms`). The kernel
here makes them from that state on the device where the batch is: one block an item walks numpy's MT19937 (each
624-word regeneration in four steps: words 0-226 from the old words, then 227-453 and 454-622 from the words the
step before made, then 623), tempers each word, pairs two words into a double as numpy does (the first's top 27
bits, the second's top 26), scales it into the range in double precision and rounds it to float32 as
`RandomState.uniform(low, high, shape).astype(np.float32)` does.

The kernel is compiled with cupy where it is installed, then checked once a process and device against numpy's own
draw from a few states (before any block boundary, across them, from position 624); where cupy is missing or the
check fails, the numbers are drawn on the host as before. A `Uniforms` read as an array (`np.asarray`) is numpy's
draw of it, so a value left on a transform is what MONAI would have left.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loaders.tail.device import to_device
from loaders.tail.graphs import capturing_for_good, keep

N = 624  # MT19937's words of state

_SOURCE = r"""
#define N 624
#define UPPER 0x80000000u
#define LOWER 0x7fffffffu
#define MAT 0x9908b0dfu
__device__ __forceinline__ unsigned int twisted(unsigned int a, unsigned int b, unsigned int m) {
    unsigned int y = (a & UPPER) | (b & LOWER);
    return m ^ (y >> 1) ^ ((y & 1u) ? MAT : 0u);
}
__device__ __forceinline__ unsigned int tempered(unsigned int y) {
    y ^= (y >> 11);
    y ^= (y << 7) & 0x9d2c5680u;
    y ^= (y << 15) & 0xefc60000u;
    y ^= (y >> 18);
    return y;
}
__device__ __forceinline__ float scaled(unsigned int a, unsigned int b, double low, double range) {
    double u = ((double)(a >> 5) * 67108864.0 + (double)(b >> 6)) / 9007199254740992.0;
    return __double2float_rn(__dadd_rn(low, __dmul_rn(range, u)));
}
// one block an item: its key (N words), meta (position, count of numbers, where its numbers begin in out),
// range (low, high - low); out: float32
extern "C" __global__ void uniforms(const unsigned int* keys, const long long* meta, const double* ranges,
                                    float* out) {
    __shared__ unsigned int mt[N];
    __shared__ unsigned int carry;
    const int item = blockIdx.x, i = threadIdx.x;
    const long long pos = meta[3 * item], words = 2 * meta[3 * item + 1], at = meta[3 * item + 2];
    const double low = ranges[2 * item], range = ranges[2 * item + 1];
    const long long end = pos + words;  // word g of the stream: word g % N of the key twisted g / N times
    if (i < N) mt[i] = keys[(long long)item * N + i];
    __syncthreads();
    for (long long base = 0; base < end; base += N) {
        if (base > 0) {
            unsigned int v = 0;
            if (i < 227) v = twisted(mt[i], mt[i + 1], mt[i + 397]);
            __syncthreads();
            if (i < 227) mt[i] = v;
            __syncthreads();
            if (i >= 227 && i < 454) v = twisted(mt[i], mt[i + 1], mt[i - 227]);
            __syncthreads();
            if (i >= 227 && i < 454) mt[i] = v;
            __syncthreads();
            if (i >= 454 && i < N - 1) v = twisted(mt[i], mt[i + 1], mt[i - 227]);
            __syncthreads();
            if (i >= 454 && i < N - 1) mt[i] = v;
            __syncthreads();
            if (i == N - 1) mt[i] = twisted(mt[i], mt[0], mt[396]);
            __syncthreads();
        }
        const long long g = base + i;
        if (i < N && g >= pos && g < end) {
            const long long j = g - pos;
            if ((j & 1) == 0) {
                if (i < N - 1) out[at + j / 2] = scaled(tempered(mt[i]), tempered(mt[i + 1]), low, range);
                else carry = tempered(mt[i]);
            } else if (i == 0) {
                out[at + j / 2] = scaled(carry, tempered(mt[0]), low, range);
            }
        }
        __syncthreads();
    }
}
"""


@dataclass(eq=False)
class Uniforms:
    """`RandomState.uniform(low, high, shape)` (then cast to `dtype`) as drawn from the state (`key`, `pos`), not
    yet drawn. Made on a CUDA device by `made`; read as an array, numpy's draw of it."""

    key: np.ndarray
    pos: int
    low: float
    high: float
    shape: tuple[int, ...]
    dtype: np.dtype = field(default_factory=lambda: np.dtype(np.float64))

    @property
    def count(self) -> int:
        return math.prod(self.shape)

    def astype(self, dtype: Any, copy: bool = True) -> Uniforms:
        return Uniforms(self.key, self.pos, self.low, self.high, self.shape, np.dtype(dtype))

    def reshape(self, *shape: Any) -> Uniforms:
        dims = tuple(shape[0]) if len(shape) == 1 and not isinstance(shape[0], int) else tuple(shape)
        if math.prod(dims) != self.count:
            raise ValueError(f"cannot reshape {self.count} numbers into {dims}")
        return Uniforms(self.key, self.pos, self.low, self.high, dims, self.dtype)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        r = np.random.RandomState()
        r.set_state(("MT19937", np.asarray(self.key, np.uint32), self.pos, 0, 0.0))
        out = r.uniform(self.low, self.high, self.shape).astype(self.dtype, copy=False)
        return out if dtype is None else out.astype(dtype, copy=False)


class Deferring:
    """A `RandomState` stand-in for one `randomize`, from `start` (a state) to `end` (the state it ends at): it
    draws as numpy does, but its one call for `count` uniform numbers is described (`Uniforms`), not drawn, and
    the `after` words drawn after them are drawn from `end` moved back by as many (`usable` says whether it can
    be: `end`'s position at least `after`)."""

    def __init__(self, start: Any, end: Any, count: int, after: int) -> None:
        self._r = np.random.RandomState()
        self._r.set_state(start)
        self._end, self._count, self._after = end, count, after
        self.deferred: Uniforms | None = None

    @staticmethod
    def usable(end: Any, after: int) -> bool:
        return int(end[2]) >= after

    def uniform(self, low: float = 0.0, high: float = 1.0, size: Any = None) -> Any:
        dims = None if size is None else ((size,) if isinstance(size, int) else tuple(int(s) for s in size))
        if self.deferred is not None or dims is None or math.prod(dims) != self._count:
            return self._r.uniform(low, high, size)
        state: Any = self._r.get_state()
        key, pos = state[1], state[2]
        self.deferred = Uniforms(np.array(key, dtype=np.uint32), int(pos), float(low), float(high), dims)
        end = self._end
        self._r.set_state((end[0], end[1], int(end[2]) - self._after, *end[3:]))
        return self.deferred

    def __getattr__(self, name: str) -> Any:
        return getattr(self._r, name)


_KERNELS: dict[int, Any] = {}
_READY: dict[int, bool] = {}
_WHY: dict[int, str] = {}  # where a device's check failed: why (its exception, or the numbers that differed)
_CHECKING: dict[int, threading.Thread] = {}
_LOCK = threading.Lock()


def _kernel(index: int) -> Any:
    import cupy

    if index not in _KERNELS:
        with cupy.cuda.Device(index):
            k = cupy.RawKernel(_SOURCE, "uniforms", options=("--std=c++11",))
            k.compile()
        _KERNELS[index] = k
    return _KERNELS[index]


def ready(device: Any) -> bool:
    """Whether `Uniforms` are made on `device` (a CUDA device): its kernel compiled and checked against numpy here,
    once a process; until the check (begun on a thread at the first call) has ended, False."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return False
    index = torch.cuda.current_device() if dev.index is None else dev.index
    if index in _READY:
        return _READY[index]
    with _LOCK:
        if index not in _CHECKING:
            _CHECKING[index] = threading.Thread(target=_check, args=(index,), name="blockprep-uniforms", daemon=True)
            _CHECKING[index].start()
    return False


def wait_ready(device: Any) -> bool:
    """`ready`, waiting for its check."""
    import torch

    ready(device)
    dev = torch.device(device)
    index = torch.cuda.current_device() if dev.index is None else dev.index
    thread = _CHECKING.get(index)
    if thread is not None:
        thread.join()
    return _READY.get(index, False)


def _check(index: int) -> None:
    """The kernel against numpy's own draw on device `index`: from before a block's end across three boundaries,
    from a block's start, from position 624, with an odd start; any difference, or no cupy, and it is not used."""
    import torch

    ok = False
    try:
        device = torch.device("cuda", index)
        r = np.random.RandomState(20261201)
        cases = []
        for pos, count in ((N - 3, 1000), (0, 5), (N, 2 * N + 1), (311, 7 * N)):
            state: Any = r.get_state()
            cases.append(Uniforms(np.array(state[1], np.uint32), pos, -1.0, 1.0, (count,), np.dtype(np.float32)))
            r.random_sample(N // 2 + 1)
        with torch.cuda.device(device):
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                got = made(cases, device)
                stream.synchronize()
        differ = [i for i, (g, u) in enumerate(zip(got, cases)) if not np.array_equal(g.cpu().numpy(), np.asarray(u))]
        ok = not differ
        if differ:
            _WHY[index] = f"the kernel's numbers differ from numpy's in cases {differ}"
    except Exception as exc:  # noqa: BLE001  (no cupy, no compiler: the numbers are drawn on the host)
        _WHY[index] = f"{type(exc).__name__}: {exc}"
    _READY[index] = ok


def why_not(device: Any) -> str:
    """Why `device`'s kernel is not used (after `wait_ready` said False): its check's exception or difference."""
    import torch

    dev = torch.device(device)
    return _WHY.get(torch.cuda.current_device() if dev.index is None else dev.index, "not checked")


def made(values: list[Uniforms], device: Any) -> list[Any]:
    """Each of `values` (float32) made on `device` by one launch on its current stream: device tensors of their
    shapes, views of one allocation."""
    import cupy
    import torch

    if not values:
        return []
    if any(u.dtype != np.float32 for u in values):
        raise ValueError("Uniforms are made on a device as float32 only")
    dev = torch.device(device)
    index = torch.cuda.current_device() if dev.index is None else dev.index
    counts = [u.count for u in values]
    starts = np.cumsum([0, *counts])
    keys = torch.from_numpy(np.stack([np.asarray(u.key, np.uint32) for u in values]).view(np.int32)).pin_memory()
    meta = torch.tensor([[u.pos, c, int(s)] for u, c, s in zip(values, counts, starts)], dtype=torch.int64)
    ranges = torch.tensor([[u.low, u.high - u.low] for u in values], dtype=torch.float64)
    stream = torch.cuda.current_stream(dev)
    pinned = (keys, meta.pin_memory(), ranges.pin_memory())
    for t in pinned:
        keep(t)  # inside a captured segment, the copies run when the segment does
    up = [t.to(dev, non_blocking=True) for t in pinned]
    out = torch.empty(int(starts[-1]), dtype=torch.float32, device=dev)
    with cupy.cuda.Device(index), _cupy_stream(cupy, stream.cuda_stream, index):
        _kernel(index)((len(values),), (N,), tuple(_pointer(t) for t in (*up, out)))
    return [out[int(s) : int(s) + c].view(u.shape) for u, c, s in zip(values, counts, starts)]


class _Handle:
    """A CUDA stream's address, shown by the CUDA stream protocol."""

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def _cupy_stream(cupy: Any, ptr: int, index: int) -> Any:
    """torch's stream `ptr` on device `index` as a cupy stream: `Stream.from_external` where this cupy has it,
    else `ExternalStream` (which newer cupy versions warn is deprecated: a warning that `-W error` makes fatal)."""
    import warnings

    external = getattr(cupy.cuda.Stream, "from_external", None)
    if external is not None:
        try:
            made = external(_Handle(ptr))
            if int(made.ptr) == ptr:
                return made
        except Exception:  # noqa: BLE001  (another signature: the older way below)
            pass
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return cupy.cuda.ExternalStream(ptr, index)


def _pointer(t: Any) -> Any:
    """A device tensor's address as a kernel argument."""
    return np.uint64(t.data_ptr())


_TOLD: bool | None = None  # this process told whether to describe its draws (a feeder's child), else None
_DEVICE: Any = None  # the CUDA device this process's tail makes its batches on, once it has made one there


def tell(defer: bool | None) -> None:
    """Whether this process's draws are described for another to make (a feeder's child, told by its parent);
    None: decided here (`deferring`)."""
    global _TOLD
    _TOLD = defer


def use_on(device: Any) -> None:
    """The device a tail here makes its batches on: where its described draws would be made (its check begun)."""
    global _DEVICE
    if getattr(device, "type", None) == "cuda" and _DEVICE is None:
        _DEVICE = device
        ready(device)


def deferring() -> bool:
    """Whether a draw here is described rather than drawn: as this process was told, else where its tail runs on
    a CUDA device whose kernel is checked (`loaders.tunables.DEVICE_DRAWS`: "0" never)."""
    from loaders import tunables

    if _TOLD is not None:
        return _TOLD
    return tunables.DEVICE_DRAWS is not False and _DEVICE is not None and ready(_DEVICE)


def on_device(values: list[Any], device: Any) -> list[Any]:
    """`values` with each `Uniforms` among them made on `device` at once (where its kernel is checked; else
    numpy's draw of it copied up); the others as they are."""
    import torch

    at = [i for i, v in enumerate(values) if isinstance(v, Uniforms)]
    if not at:
        return values
    out = list(values)
    if capturing_for_good():
        raise RuntimeError("a batch's described draws cannot go into a graph replayed for good")
    if wait_ready(device):
        for i, t in zip(at, made([values[i] for i in at], device)):
            out[i] = t
        return out
    for i in at:
        out[i] = to_device(torch.from_numpy(np.asarray(values[i])), device)
    return out
