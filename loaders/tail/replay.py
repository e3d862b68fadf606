"""A tail replayed: a batch's draws made on the host (`loaders.tail.plans`), its work launched as CUDA graphs
captured once for each transform and kind of draw, the draws copied up into them from page-locked host memory.

Where every transform of a tail has a plan for the batch's shapes and dtypes, a batch costs the host its draws
(MONAI's `randomize`, item by item) and one graph launch a transform, not the Python of each kernel. Made in the
training process, a tail's Python costs the step about a third (`python -m workflows.bench.tail_bound --here`:
the tail run on a thread there), its graphs replayed there about nothing (docs/benchmarks.md).

The batch passes through static buffers: the input copied into the first, each transform's graph reading one and
writing the next (the entries it leaves are the same tensors), the last copied out for the caller. Before each
launch its draws are copied up into the device tensors it reads, from page-locked memory, so the host never waits
for the GPU (a graph copying from host memory of its own could only be given the next draws once its last launch had
run: the tail could not run ahead). Off a CUDA device the same plans run eagerly, as the tests check them against
MONAI anywhere.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from loaders.tail.graphs import holding
from loaders.tail.plans import AS_IS, Drawn, Like, Plan, plan_of

_log = logging.getLogger("loaders.tail")

DRAWN = "_drawn"  # a batch's entry holding its tail's draws (`Drawings`), made where the batch was


class Drawings:
    """A batch's draws, transform by transform (`ReplayedTail.draw`), as one value of the batch (not a list the
    batch's collation would read as one entry per item)."""

    __slots__ = ("drawn",)

    def __init__(self, drawn: list[Any]) -> None:
        self.drawn = drawn

    def __reduce__(self) -> Any:
        return (Drawings, (self.drawn,))


@dataclass
class _Graph:
    """One transform's graph for one kind of draw, and the device tensors it reads the draws from."""

    graph: Any
    dev: dict[str, Any]
    held: list[Any]  # the host tensors of constants its copies read
    checks: list[tuple[Any, BaseException]]  # device flags its work leaves where MONAI would have raised (its memory)


def _entries(batch: Mapping[Hashable, Any], n: int) -> list[Hashable]:
    """The entries the tail's buffers hold: per-item tensors on the device of the batch's first (n, C, ...) one
    (the others, a class label left on the CPU, pass through as they are)."""
    import torch

    device = next(v.device for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim > 1)
    return [k for k, v in batch.items() if _per_item(v, n) and v.device == device]


def _like(batch: Mapping[Hashable, Any], n: int) -> Like:
    import torch

    return {k: torch.empty(batch[k].shape, dtype=batch[k].dtype, device="meta") for k in _entries(batch, n)}


def _per_item(value: Any, n: int) -> bool:
    import torch

    return isinstance(value, torch.Tensor) and value.ndim >= 1 and int(value.shape[0]) == n


def _batch_size(batch: Mapping[Hashable, Any]) -> int | None:
    import torch

    sizes = {int(v.shape[0]) for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim > 1}
    return sizes.pop() if len(sizes) == 1 else None


def plans_of(transforms: Sequence[Any], like: Like) -> tuple[list[Plan], list[Like]] | None:
    """Each transform's plan and the batch before each (and after the last), or None where one has no plan."""
    plans, likes = [], [like]
    n = int(next(iter(like.values())).shape[0])
    for t in transforms:
        try:
            plan = plan_of(t, likes[-1])
            parts = [] if plan is None else plan.parts()
            for part in parts:  # each part's output shapes, on the part before's
                likes.append({**likes[-1], **part.apply(likes[-1], part.values_like(n), ())})
        except (AttributeError, TypeError, ValueError, RuntimeError, KeyError) as e:  # a MONAI of other attributes
            _log.info("ReplayedTail: no plan for %s here (%r); the tail runs as the others", type(t).__name__, e)
            return None
        if plan is None:
            return None
        plans.extend(parts)
    return plans, likes


class ReplayedTail:
    """`transforms` (MONAI dictionary transforms, each with a plan) run over whole batches: draws here, work as
    graphs (`capture`, on a CUDA device) or eagerly. Not thread-safe: one caller a tail."""

    def __init__(self, transforms: Sequence[Any], capture: bool = True) -> None:
        self.transforms = list(transforms)
        self.capture = capture
        self._chains: dict[Any, _Chain | None] = {}
        # the last batch's device flags where MONAI would have raised (`loaders.tail.checks`), from its eager steps
        self.checks: list[tuple[Any, BaseException]] = []
        self.done: Any = None  # a CUDA event after the last replay's reads of its input and draws (None: eager)

    @property
    def captures(self) -> int:
        """Graphs captured, all batch shapes."""
        return sum(c.captures for c in self._chains.values() if c is not None)

    def covers(self, batch: Mapping[Hashable, Any]) -> bool:
        """Whether every transform has a plan for a batch like this one (on a CUDA device, one exact there)."""
        chain = self._chain(batch)
        if chain is None:
            return False
        cuda = batch[next(iter(chain.likes[0]))].is_cuda
        return not cuda or all(plan.exact_on_cuda for plan in chain.plans)

    def _chain(self, batch: Mapping[Hashable, Any]) -> _Chain | None:
        n = _batch_size(batch)
        if n is None:
            return None
        spec = tuple((k, tuple(batch[k].shape), batch[k].dtype, batch[k].device) for k in _entries(batch, n))
        if spec not in self._chains:
            found = plans_of(self.transforms, _like(batch, n))
            self._chains[spec] = None if found is None else _Chain(n, *found)
        return self._chains[spec]

    def drawable(self, batch: Mapping[Hashable, Any]) -> bool:
        """Whether the batch's draws alone can be made here and its work replayed elsewhere (`draw`, then `replay`
        in another process, on any device): every transform planned, none run eagerly (those draw where they run),
        each exact on a CUDA device."""
        chain = self._chain(batch)
        return chain is not None and all(not plan.eager and plan.exact_on_cuda for plan in chain.plans)

    def run(self, batch: Mapping[Hashable, Any]) -> dict[Hashable, Any]:
        """The batch through the tail (entries that are not per-item tensors passed through as they are)."""
        return self.replay(batch, self.draw(batch))

    def draw(self, batch: Mapping[Hashable, Any]) -> list[Any]:
        """The batch's draws, transform by transform (each a `Drawn`, or a per-item plan's list of them)."""
        chain = self._chain(batch)
        if chain is None:
            raise ValueError("ReplayedTail: a transform has no plan for this batch (check `covers` first)")
        return [d for plan in chain.plans if not plan.follows for d in plan.draw_all(chain.n)]

    def replay(self, batch: Mapping[Hashable, Any], drawn: list[Any], device: Any = None) -> dict[Hashable, Any]:
        """The batch through the tail's work from `drawn` (`draw`'s, here or in another process), on `device` (the
        batch's own by default: a batch in page-locked host memory is copied up into the first buffers)."""
        chain = self._chain(batch)
        if chain is None:
            raise ValueError("ReplayedTail: a transform has no plan for this batch (check `covers` first)")
        out = dict(batch)
        first = batch[next(iter(chain.likes[0]))]
        on_cuda = (first.device if device is None else _device(device)).type == "cuda"
        chain.checks = []
        self.done = None
        if self.capture and on_cuda:
            out.update(chain.run(batch, drawn, device))
            self.done = chain.done
        else:
            out.update(chain.eager({k: batch[k].to(device) for k in chain.likes[0]} if device else batch, drawn))
        self.checks = chain.checks
        return out


class _Chain:
    """A tail's plans for one batch spec, its static buffers and graphs."""

    def __init__(self, n: int, plans: list[Plan], likes: list[Like]) -> None:
        self.n, self.plans, self.likes = n, plans, likes
        self.captures = 0
        # the eager steps' device flags where MONAI would have raised, of the batch being run
        self.checks: list[tuple[Any, BaseException]] = []
        self.buffers: list[dict[Hashable, Any]] = []
        self.graphs: dict[Any, _Graph] = {}
        self.items: dict[int, tuple[dict[Hashable, Any], dict[Hashable, Any]]] = {}  # a per-item plan's item buffers
        self.pool: Any = None
        self.stream: Any = None
        self.done: Any = None  # the last run's work, its reads of host memory included
        self.made: dict[int, Any] = {}  # the batch's described draws made on the device, by the id of each

    def eager(self, batch: Mapping[Hashable, Any], drawn: list[Any]) -> dict[Hashable, Any]:
        import torch

        data = {k: batch[k] for k in self.likes[0]}
        for plan, d in zip(self.plans, drawn):
            device = data[plan.keys[0]].device
            if plan.eager:
                data.update(self._eager_step(plan, data))
                continue
            if not plan.per_item:
                data.update(plan.apply(data, _up(d, device), d.kind))
                self._checked(plan)
                continue
            rows = [plan.apply({k: data[k][i : i + 1] for k in plan.keys}, _up(di, device), di.kind)
                    for i, di in enumerate(d)]  # fmt: skip
            data.update({k: torch.cat([r[k] for r in rows]) for k in plan.keys})
            self._checked(plan)
        return data

    def run(self, batch: Mapping[Hashable, Any], drawn: list[Any], device: Any = None) -> dict[Hashable, Any]:
        import torch

        device = batch[next(iter(self.likes[0]))].device if device is None else _device(device)
        if self.stream is None:
            self._make_buffers(device)
        caller = torch.cuda.current_stream(device)
        if batch[next(iter(self.likes[0]))].is_cuda:  # made on the caller's stream (from the host: nothing to wait for)
            self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            for k, buf in self.buffers[0].items():
                buf.copy_(batch[k], non_blocking=True)  # from page-locked host memory too, without waiting
            self.made = _made(drawn, device)
            for j, (plan, d) in enumerate(zip(self.plans, drawn)):
                if plan.eager or not plan.graphed:
                    src, dst = self._views(j, None)
                    if plan.eager:
                        got = self._eager_step(plan, src)
                    else:
                        got = plan.apply(src, _up(d, device), d.kind)
                        self._checked(plan)
                    for k in plan.keys:
                        dst[k].copy_(got.get(k, src[k]))
                elif plan.per_item:
                    if any(di.kind == AS_IS for di in d):  # the items left as they are: copied over first
                        for k in plan.keys:
                            self.buffers[j + 1][k].copy_(self.buffers[j][k])
                    for i, di in enumerate(d):
                        if di.kind != AS_IS:
                            self._launch(j, plan, di, i)
                else:
                    self._launch(j, plan, d, None)
            out = {k: v.clone() for k, v in self.buffers[-1].items()}
            self.done = torch.cuda.Event()
            self.done.record(self.stream)  # the input and the draws read from the host: a host buffer free after it
        caller.wait_stream(self.stream)
        for v in out.values():
            v.record_stream(caller)
        return out

    def _checked(self, plan: Plan) -> None:
        """The device flags where MONAI would have raised that a plan's eager work left (`Plan.checks`), taken."""
        self.checks.extend(plan.checks)
        plan.checks = []

    def _eager_step(self, plan: Plan, data: dict[Hashable, Any]) -> dict[Hashable, Any]:
        """An eager step's entries: its batched version on the batch (never written), else MONAI item by item; the
        entries it leaves in another shape or dtype than the buffers' raise (never copied in converted)."""
        from loaders.errors import PrepError
        from loaders.tail.batched import _handler, _per_item
        from loaders.tail.tailbatch import TailBatch

        tb = TailBatch.from_batch(data)
        handler = _handler(plan.t)
        if handler is None or not handler(plan.t, tb):
            _per_item(plan.t, tb)
        out = tb.result()
        self.checks.extend(tb.checks)
        for k in plan.keys:
            if out[k].shape != data[k].shape or out[k].dtype != data[k].dtype:
                raise PrepError(f"ReplayedTail: {type(plan.t).__name__} left {k!r} as {tuple(out[k].shape)} "
                                f"{out[k].dtype}, not {tuple(data[k].shape)} {data[k].dtype}; run it with "
                                "BLOCKPREP_TAIL_REPLAY=0 and report it")  # fmt: skip
        return {k: out[k] for k in plan.keys}

    def _launch(self, j: int, plan: Plan, d: Drawn, row: int | None) -> None:
        """Plan j's graph for this draw launched after its draws' copies up (from page-locked memory, without
        waiting: the caching host allocator holds each block until its copy has run, so the host never waits for the
        GPU here): on the batch, or on item `row` (a per-item plan: the item copied into the plan's item buffers and
        back, so that its graphs are one per kind, whatever the row)."""
        key = (j, d.kind, tuple((name, tuple(a.shape), str(a.dtype)) for name, a in d.values.items()))
        g = self.graphs.get(key) or self._capture(key, j, plan, d, row)
        for name, a in d.values.items():
            g.dev[name].copy_(self._source(a), non_blocking=True)
        if row is None:
            g.graph.replay()
            self.checks.extend((flag.clone(), e) for flag, e in g.checks)  # before the next replay writes them
            return
        ins, outs = self._views(j, row)
        for k in plan.keys:
            ins[k].copy_(self.buffers[j][k][row : row + 1])
        g.graph.replay()
        self.checks.extend((flag.clone(), e) for flag, e in g.checks)
        for k in plan.keys:
            self.buffers[j + 1][k][row : row + 1].copy_(outs[k])

    def _source(self, value: Any) -> Any:
        """What a draw's value is copied up from: made on the device already (`_made`), else page-locked."""
        got = self.made.get(id(value))
        return _pinned(value) if got is None else got

    def _views(self, j: int, row: int | None) -> tuple[dict[Hashable, Any], dict[Hashable, Any]]:
        """Plan j's input and output buffers: the batch's, or (a per-item plan's, `row` given) an item's own."""
        if row is None:
            return self.buffers[j], self.buffers[j + 1]
        if j not in self.items:
            import torch

            keys = self.plans[j].keys
            self.items[j] = ({k: torch.empty_like(self.buffers[j][k][:1]) for k in keys},
                             {k: torch.empty_like(self.buffers[j + 1][k][:1]) for k in keys})  # fmt: skip
        return self.items[j]

    def _make_buffers(self, device: Any) -> None:
        import torch

        from loaders.tail.device import tail_stream
        from loaders.tail.graphs import _warm

        # the device's highest priority: at the default, a capture's wait and each graph's launch behind the last
        # (a per-item plan's) waited for the training step's queued kernels (cProfile: 60 ms a launch, host-fed)
        self.stream = tail_stream(device)
        with torch.cuda.stream(self.stream):
            _warm(device)  # cuBLAS's and cuDNN's handles made before a capture
        for j, like in enumerate(self.likes):
            before = self.buffers[-1] if self.buffers else {}
            changed = set(self.plans[j - 1].keys) if j else set(like)
            kept = {k: before[k] for k in like if k not in changed and k in before}
            made = {k: torch.empty(v.shape, dtype=v.dtype, device=device) for k, v in like.items() if k not in kept}
            self.buffers.append({k: kept[k] if k in kept else made[k] for k in like})

    def _capture(self, key: Any, j: int, plan: Plan, d: Drawn, row: int | None) -> _Graph:
        import torch

        device = self.stream.device
        given = {name: self._source(a) for name, a in d.values.items()}
        dev = {name: torch.empty(tuple(h.shape), dtype=h.dtype, device=device) for name, h in given.items()}
        src, dst = self._views(j, row)
        if row is not None:  # the warm-up below works on this item
            for k in plan.keys:
                src[k].copy_(self.buffers[j][k][row : row + 1])

        def work() -> None:
            for k, v in plan.apply(src, dev, d.kind).items():
                dst[k].copy_(v)

        for name, h in given.items():
            dev[name].copy_(h, non_blocking=True)
        work()  # once outside the capture: what a first call sets up is not captured
        plan.checks = []  # its flags are that run's; the graph's own are kept with it
        self.stream.synchronize()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph, held = torch.cuda.CUDAGraph(), list[Any]()
        # a graph freed by the collector during a capture on this thread ends the capture (CUDA refuses to destroy
        # one then): no collection while capturing
        was_enabled = gc.isenabled()
        gc.disable()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        try:
            with holding(held):  # constants a plan copies up from pinned memory: held as long as the graph
                work()
        finally:
            graph.capture_end()
            if was_enabled:
                gc.enable()
        self.captures += 1
        self.graphs[key] = _Graph(graph, dev, held, plan.checks)
        plan.checks = []
        return self.graphs[key]


def _made(drawn: list[Any], device: Any) -> dict[int, Any]:
    """The batch's described draws made on `device`, by id: its `loaders.tail.uniforms.Uniforms` by one launch,
    its `loaders.tail.products.Products` each by one product there."""
    from loaders.tail.products import Products
    from loaders.tail.uniforms import Uniforms, on_device

    values = [v for d in drawn for di in (d if isinstance(d, list) else [d]) if isinstance(di, Drawn)
              for v in di.values.values()]  # fmt: skip
    uniforms = [v for v in values if isinstance(v, Uniforms)]
    made = {id(v): t for v, t in zip(uniforms, on_device(uniforms, device))}
    made.update({id(v): v.on(device) for v in values if isinstance(v, Products)})
    return made


def _pinned(value: Any) -> Any:
    """A draw's value as a page-locked host tensor (a numpy array copied into one; a tensor pinned already as is)."""
    import torch

    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value)).pin_memory()
    return value if value.is_pinned() else value.pin_memory()


def _device(device: Any) -> Any:
    import torch

    return torch.device(device)


def _up(d: Drawn, device: Any) -> dict[str, Any]:
    """A draw's values on `device` (eagerly)."""
    import torch

    from loaders.tail.products import Products
    from loaders.tail.uniforms import Uniforms, on_device

    def up(a: Any) -> Any:
        if isinstance(a, Products):
            return a.on(device)
        if isinstance(a, Uniforms):
            return on_device([a], device)[0] if torch.device(device).type == "cuda" else torch.from_numpy(np.asarray(a))
        if isinstance(a, np.ndarray):
            return torch.from_numpy(a).to(device)
        return a.to(device) if isinstance(a, torch.Tensor) else a  # an ungraphed plan's draws as they are

    return {name: up(a) for name, a in d.values.items()}
