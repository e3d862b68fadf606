"""The dask side of `prep cache`: start or reach a cluster, warm its workers, run the batches, report progress.

The default local cluster runs in this process: one dask worker with `workers` threads. The head's heavy
work (zlib inflate, torch resampling) releases the GIL, so threads use the cores like processes do, without
starting any. `processes=True` starts `workers` processes instead, the cores shared out among them as torch
threads (isolation from crashing transforms, Python-heavy custom transforms), forked by a forkserver that
has imported torch and MONAI (`prep.processes`); that start and the warming of each worker with the pipeline
run on a thread.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

from loaders.cache import chain
from prep.errors import PrepError, UsageError
from prep.finish import settle_commits, wait_commits
from prep.pipeline import BUNDLE_SUFFIXES, DEFAULT_BUNDLE_KEY
from prep.processes import cpu_seconds, seconds_to_ready, start_forkserver, worker_environ
from prep.worker import TaskSpec, clear_stop, ignore_sigint, request_stop, run_batch, warm, warm_torch

Progress = Callable[[int, int], None]  # (items just finished, items this run will do)
Sink = Callable[[list[dict[str, Any]]], None]  # a finished task's statuses (`prep.worker.run_batch`)
TLS_OPTIONS = "--tls-ca-file, --tls-cert and --tls-key"
STOP_WAIT_S = 60.0  # after Ctrl-C, how long running tasks get to finish their current item
POLL_S = 0.05  # how often the wait for results looks at the Ctrl-C flag


def plain_tcp_warning(scheduler: str | None) -> str | None:
    """One warning line for a plain tcp:// scheduler on a non-loopback address (anyone who reaches it can run
    code as its workers' user), else None."""
    import ipaddress
    from urllib.parse import urlsplit

    if not scheduler or not scheduler.startswith("tcp://"):
        return None
    host = urlsplit(scheduler).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: not provably loopback
        loopback = False
    if loopback:
        return None
    return (
        f"{scheduler} is plain tcp:// on a non-loopback address: any client that reaches it can run code as the "
        f"workers' user; use a tls:// scheduler with {TLS_OPTIONS} (see docs/security.md)"
    )


def scheduler_security(
    scheduler: str | None, ca_file: str | Path | None = None, cert: str | Path | None = None,
    key: str | Path | None = None,
) -> Any:  # fmt: skip
    """A distributed `Security` for a tls:// scheduler from certificate files (None for tcp:// or local).

    All three files are needed: the CA that signed the cluster's certificates, and this client's own
    certificate and key (dask's TLS scheduler refuses clients without a certificate its CA signed).
    """
    given = {"--tls-ca-file": ca_file, "--tls-cert": cert, "--tls-key": key}
    if not any(given.values()):
        if scheduler and scheduler.startswith("tls://"):
            raise UsageError(f"{scheduler}: a TLS scheduler needs {TLS_OPTIONS} (its CA, this client's certificate)")
        return None
    missing = [name for name, value in given.items() if not value]
    if missing:
        raise UsageError(f"TLS needs all of {TLS_OPTIONS}; missing {', '.join(missing)}")
    for name, value in given.items():
        if not Path(str(value)).is_file():
            raise UsageError(f"{value}: {name} file not found")
    if not (scheduler or "").startswith("tls://"):
        raise UsageError(f"{TLS_OPTIONS} are for a tls:// scheduler; got --scheduler {scheduler or '(none)'}")
    from distributed.security import Security

    return Security(tls_ca_file=str(ca_file), tls_client_cert=str(cert), tls_client_key=str(key),
                    require_encryption=True)  # fmt: skip


def check_security(scheduler: str | None, security: Any) -> None:
    """Refuse a Security for an unencrypted or local cluster (it would be silently unused or fail obscurely),
    and a tls:// address without one."""
    if security is None:
        if scheduler and scheduler.startswith("tls://"):
            raise UsageError(f"{scheduler}: a TLS scheduler needs a Security (CLI: {TLS_OPTIONS})")
        return
    if not (scheduler or "").startswith("tls://"):
        raise UsageError(f"a Security was given for {scheduler or 'a local cluster'}; it applies to tls:// schedulers")


def local_cores() -> int:
    """CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def items_per_worker(workers: int, cores: int | None = None) -> int:
    """Items each local worker (a thread, or a process) prepares at once: the cores beyond one a worker, up to
    THREAD_SCALING, so that a run with fewer workers than cores still fills them. torch's intra-op threads
    scale poorly on a head's resampling; items side by side do better (docs/benchmarks.md, Preparation: what
    `prep cache`'s defaults rest on)."""
    cores = local_cores() if cores is None else cores
    return max(1, min(int(THREAD_SCALING), cores // max(1, workers)))


HEAD_PEAK_FACTOR = 4  # a head's peak memory per decoded input byte (a float32 copy of uint8/int16 data, resampling)


def heads_at_once(
    workers: int, processes: bool, item_bytes: int | None, available: int, cores: int | None = None
) -> int:
    """Heads each worker process may run at once: its workers' items side by side (`items_per_worker`), no more
    than the memory allows for items of `item_bytes` decoded input bytes (HEAD_PEAK_FACTOR each), and never
    fewer than one per worker, as before the items side by side. `item_bytes` None (not measured): one per
    worker."""
    each = items_per_worker(workers, cores)
    per_process = each if processes else workers * each
    floor = 1 if processes else workers
    if not item_bytes:
        return floor
    fit = available // (HEAD_PEAK_FACTOR * item_bytes * (workers if processes else 1))
    return max(floor, min(per_process, int(fit)))


def torch_threads_for(workers: int, scheduler: str | None, processes: bool = False) -> int:
    """Intra-op threads per item on a local cluster: cores / workers, threads or processes alike (a
    DataLoader's workers get 1 each, which leaves cores idle below one worker a core); 0 on a remote cluster:
    its workers keep their own setting. Not divided again by the items a worker runs side by side: the bits of
    torch's float ops can depend on its thread count (1 ULP where a vectorised loop is split between threads),
    and one worker's cores as torch threads is what MONAI's own chain gets in the caller's process (OpenMP's
    idle threads sleep, `prep.cli`; measured: docs/benchmarks.md, Preparation)."""
    if scheduler:
        return 0
    return max(1, local_cores() // workers)


@contextmanager
def worker_process_env(threads: int) -> Iterator[None]:
    """dask config for starting local worker processes fit for torch heads (`prep.processes.worker_environ`;
    variables already in the environment still win, as dask reads them first); the caller's environment is
    restored afterwards, as the nanny writes these variables into it before each start."""
    import dask

    env = worker_environ(threads)
    keys = {*env, *dask.config.get("distributed.nanny.pre-spawn-environ", {})}
    saved = {key: os.environ.get(key) for key in keys}
    try:
        with dask.config.set({f"distributed.nanny.pre-spawn-environ.{k}": v for k, v in env.items()}):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _connect(scheduler: str, security: Any) -> Any:
    """A Client of an existing scheduler; a refused or unreachable one becomes one UsageError line."""
    from distributed import Client

    try:
        return Client(scheduler, set_as_default=False, timeout="10s", security=security)
    except (OSError, TimeoutError) as exc:
        # a TLS scheduler refusing this client's certificate (or a plain tcp:// client) looks like a timeout
        hint = f"; a tls:// scheduler also needs {TLS_OPTIONS} signed by its CA" if security is None else (
            "; or the scheduler refused this certificate (not signed by its CA?)")  # fmt: skip
        reason = re.sub(r"^in <[^>]*>: ", "", " ".join(str(exc).split()))[:200]  # drop the comm's repr
        raise UsageError(
            f"cannot reach the dask scheduler at {scheduler} ({reason}); check --scheduler{hint}"
        ) from None


def hold_gc_diagnosis(stack: ExitStack) -> None:
    """Turns dask's gc statistics on here, on the caller's thread, until `stack` closes (after the cluster).

    dask's scheduler and worker add a gc callback when they start. Added on the start thread while this thread
    is inside a full collection (a finalizer has released the GIL), the callback sees the collection end without
    its start and raises AssertionError inside gc ("Exception ignored in GCDiagnosis._gc_callback"). Held here,
    their start only counts one more user of the callback already in place."""
    from distributed.gc import disable_gc_diagnosis, enable_gc_diagnosis

    enable_gc_diagnosis()
    stack.callback(disable_gc_diagnosis)


class ClusterStarter:
    """Connects to `scheduler`, or starts a LocalCluster of `workers` threads (or processes forked
    by the forkserver, see prep.processes), on a thread; then loads `pipeline` on every worker process.
    `client()` waits for it; use as a context manager. `worker_cpu_s`: after close, the CPU seconds the local
    worker processes used (they are not this process's children); `start_cpu_s`: theirs once started."""

    def __init__(
        self, workers: int, scheduler: str | None, processes: bool = True, pipeline: str | Path | None = None,
        bundle_key: str | None = None, security: Any = None,
    ) -> None:  # fmt: skip
        self._stack = ExitStack()
        self._client: Any = None
        self._error: BaseException | None = None
        self._in_process = not (processes or scheduler)
        self.processes = bool(processes) and not scheduler  # local worker processes (not threads, not a scheduler)
        self.pids: list[int] = []  # local worker processes
        self.worker_cpu_s = 0.0
        self.start_cpu_s = 0.0  # the local worker processes' CPU seconds once started and warm
        target = None
        if pipeline is not None:
            path = Path(pipeline).resolve()
            key = bundle_key or (DEFAULT_BUNDLE_KEY if path.suffix in BUNDLE_SUFFIXES else None)
            target = (str(path), key)
        if not scheduler:  # a local cluster: its scheduler (and in-process worker) run on this process's threads
            hold_gc_diagnosis(self._stack)
        self._thread = threading.Thread(
            target=self._start,
            args=(workers, scheduler, processes, target, security),
            name="blockprep-cluster",
            daemon=True,
        )
        self._thread.start()

    def _start(
        self, workers: int, scheduler: str | None, processes: bool, target: tuple | None, security: Any
    ) -> None:  # fmt: skip
        import dask
        from distributed import Client, LocalCluster

        try:
            if scheduler:
                client = _connect(scheduler, security)
            else:
                # in-process: no memory limit, since a worker inside the caller's process would pause (and the
                # run hang) at a share of memory the caller's own data may already hold; task results are tiny
                shape: dict[str, Any] = (
                    {"n_workers": workers, "threads_per_worker": items_per_worker(workers)}
                    if processes
                    else {"n_workers": 1, "threads_per_worker": workers * items_per_worker(workers), "memory_limit": 0}
                )
                with ExitStack() as env:
                    # dask's profiler samples every worker thread's stack each 10 ms, for a dashboard nobody opens
                    env.enter_context(dask.config.set({"distributed.worker.profile.enabled": False}))
                    # a task goes to a worker only when one of its threads is free (dask's default, 1.1, queues
                    # a second task on a busy one-thread worker, which may then run it while others are idle)
                    env.enter_context(dask.config.set({"distributed.scheduler.worker-saturation": 1.0}))
                    if processes:
                        threads = torch_threads_for(workers, None, processes)
                        start_forkserver(threads)  # a no-op where prep cache started it while planning
                        env.enter_context(worker_process_env(threads))
                        env.enter_context(dask.config.set({"distributed.worker.multiprocessing-method": "forkserver"}))
                    cluster = self._stack.enter_context(
                        LocalCluster(**shape, processes=processes, dashboard_address=":0", silence_logs=logging.ERROR)
                    )  # fmt: skip
                client = Client(cluster, set_as_default=False)
            self._client = self._stack.enter_context(client)
        except BaseException as exc:  # handed to the main thread by client()
            self._error = exc
            return
        if processes and not scheduler:  # Ctrl-C reaches the whole process group: prep cache handles it
            with suppress(Exception):
                self.pids = list(self._client.run(ignore_sigint).values())
        # an in-process worker shares the main thread's imports: nothing to warm
        if target is not None and (processes or scheduler):
            # the tasks themselves report a pipeline that does not load, with its reason
            # local processes take what this process found of the transforms' classes (same installation)
            found = chain.runtime_attrs_found() if processes and not scheduler else None
            with suppress(Exception):
                self._client.run(warm, *target, found)
        if processes and not scheduler:  # what starting them cost (on this thread: beside the probe)
            with suppress(Exception):
                self.start_cpu_s = sum(self._client.run(cpu_seconds).values())

    def client(self) -> Any:
        """The connected distributed.Client (waits for the start; re-raises its error)."""
        self._thread.join()
        if self._error is not None:
            raise self._error
        if self._in_process:
            warm_torch()  # on the caller's (main) thread, before the worker threads get tasks: see warm_torch
        return self._client

    def close(self) -> None:
        """Close the client and the local cluster (after the start thread is done)."""
        self._thread.join()
        if self.pids and self._client is not None:
            with suppress(Exception):
                self.worker_cpu_s = sum(self._client.run(cpu_seconds).values())
        self._stack.close()
        settle_commits()  # in-process workers' endings of a run stopped by an error (else none are pending)

    def __enter__(self) -> ClusterStarter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# the auto rule's constants (see choose_processes); the measurements behind them: docs/benchmarks.md, Preparation
PROCESS_START_S = 1.0  # forking the workers from a forkserver whose imports are done, warming them
THREAD_SCALING = 4.0  # worker threads stop gaining past ~4 for heads that release the GIL
SMALL_ITEM_S = 0.02  # below this per item, the head is mostly Python (2D images): threads share one GIL
SMALL_THREAD_SCALING = 1.0  # such small items: a second thread made them slower, not faster
TASK_S = 1.0  # a task of small items holds at least this much work, so dask's per-task cost stays small


def choose_processes(
    workers: int, n_todo: int, item_s: float | None, cuda: bool = False, start_s: float = PROCESS_START_S,
    cores: int | None = None,
) -> bool:  # fmt: skip
    """The `--workers` mode auto: processes when they are expected to finish first, else threads; always
    threads for a head that touches CUDA (`cuda`): its work runs on the GPU outside the GIL, and each process
    would hold a CUDA context of its own.

    Each worker runs `items_per_worker` items at once. Threads start at once but share one GIL: heads that
    release it (zlib, torch resampling) scale to about THREAD_SCALING items in all, mostly-Python heads of
    small items to about SMALL_THREAD_SCALING (no gain). Processes scale with the workers (each to
    THREAD_SCALING items) and cost `start_s` to start (worker_mode adds what the forkserver has left to
    import). `item_s` is the head's time on one item, measured on this process before the run (None: not
    measured, threads). `cores`: this machine's (default `local_cores()`).
    """
    at_once = workers * items_per_worker(workers, cores)
    if cuda or at_once < 2 or item_s is None or n_todo <= at_once:
        return False
    scaling = THREAD_SCALING if item_s >= SMALL_ITEM_S else SMALL_THREAD_SCALING
    threads_s = n_todo * item_s / min(at_once, scaling)
    processes_s = start_s + n_todo * item_s / (workers * min(items_per_worker(workers, cores), scaling))
    return processes_s < threads_s


def batch_size_for(n_todo: int, workers: int, batch_size: int | None = None, item_s: float | None = None) -> int:
    """Items per task: about 8 tasks per worker, so the last tasks leave workers idle for little time; at most
    32 items (a task also costs a shard and a journal file), or as many as TASK_S of work for small items."""
    if batch_size:
        return batch_size
    most = 32 if not item_s else max(32, math.ceil(TASK_S / item_s))
    return max(1, min(most, -(-n_todo // (workers * 8))))


def task_batches(todo: list[int], size: int, singles: int = 0) -> list[list[int]]:
    """`todo` in tasks of `size` items in order, the last `singles` items one a task: a worker that takes the
    last task while the others finish theirs then waits for one item, not a whole task (docs/benchmarks.md,
    Preparation)."""
    cut = len(todo) - min(len(todo), singles) if size > 1 else len(todo)
    head, tail = todo[:cut], todo[cut:]
    return [head[i : i + size] for i in range(0, len(head), size)] + [[i] for i in tail]


@contextmanager
def interrupt_scope() -> Iterator[None]:
    """A run's scope: its tasks may run (an earlier run in this process may have been stopped by Ctrl-C, as in a
    notebook); this thread's Ctrl-C handler is restored on the way out (run_tasks replaces it after a first
    Ctrl-C)."""
    clear_stop()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGINT)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)


def _stop_after_interrupt(client: Any, futures: list[Any], pids: list[int]) -> None:
    """After a first Ctrl-C: a second one exits at once; tasks stop after their current item and commit it."""
    if threading.current_thread() is threading.main_thread():

        def exit_now(signum: int, frame: Any) -> None:
            sys.stderr.write(
                "interrupted again: stopped now; finished items are kept; run the same command again to resume\n"
            )
            for pid in pids:  # the journals are crash-safe: this is the kill -9 that resumes bit-identical
                with suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            os._exit(130)

        signal.signal(signal.SIGINT, exit_now)
    # closing the cluster under running tasks logs their cancellation (tracebacks) at ERROR level
    logging.getLogger("distributed").setLevel(logging.CRITICAL)
    request_stop()  # in-process worker threads
    if pids:
        with suppress(Exception):
            client.run(request_stop)
    from distributed import wait

    with suppress(Exception):
        wait(futures, timeout=STOP_WAIT_S)
    with suppress(Exception):  # the stopped tasks' last commits
        client.run(wait_commits)


def run_tasks(
    client: Any,
    spec: TaskSpec,
    items: list[tuple[str, dict[str, Any]]],
    todo: list[int],
    size: int,
    progress: Progress | None = None,
    pids: list[int] | None = None,
    sink: Sink | None = None,
    singles: int = 0,
    commit_later: bool = False,
) -> None:
    """Submit one task per batch of `size` items (the last `singles` items one a task) and wait; with
    `commit_later`, tasks make their last items durable after they return (`prep.finish`) and this waits for
    that on every worker too (a local cluster: a remote worker may be lost after its task returned, which dask
    would not notice). A worker that keeps dying becomes a PrepError. Ctrl-C stops the tasks after their
    current item (a second one exits at once); `pids`: local workers; `sink` takes each finished task's
    statuses (`run_batch`)."""

    clear_stop()
    quiet = _QuietAfterInterrupt()
    tornado_log = logging.getLogger("tornado.application")
    tornado_log.addFilter(quiet)
    if threading.current_thread() is threading.main_thread():  # interrupt_scope restores the handler
        signal.signal(signal.SIGINT, quiet.interrupt)
    try:
        batches = task_batches(todo, size, singles)
        _wait_tasks(client, spec, items, todo, batches, progress, pids, sink, commit_later, quiet.interrupted)
        if commit_later:
            client.run(wait_commits)
    finally:
        tornado_log.removeFilter(quiet)


class _QuietAfterInterrupt(logging.Filter):
    """After a Ctrl-C, tornado's log of distributed's own cancellation callbacks (a NameError in some versions'
    `sync`) is dropped: the user sees the one `interrupted` line. The flag is set in the signal handler, before
    the interrupted wait schedules its callbacks."""

    def __init__(self) -> None:
        super().__init__()
        self.interrupted = threading.Event()

    def interrupt(self, signum: int, frame: Any) -> None:
        self.interrupted.set()
        raise KeyboardInterrupt

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.interrupted.is_set()


def _wait_tasks(
    client: Any,
    spec: TaskSpec,
    items: list[tuple[str, dict[str, Any]]],
    todo: list[int],
    batches: list[list[int]],
    progress: Progress | None,
    pids: list[int] | None,
    sink: Sink | None = None,
    commit_later: bool = False,
    interrupted: threading.Event | None = None,
) -> None:
    """Wait for the tasks, looking at `interrupted` (set by the Ctrl-C handler) between results: the handler's
    KeyboardInterrupt can land in an object's `__del__`, where Python prints it and goes on."""
    from distributed import as_completed

    interrupted = interrupted or threading.Event()
    futures = [
        client.submit(run_batch, spec, b, [(i, items[i][1], items[i][0]) for i in batch], commit_later=commit_later,
                      pure=False, key=f"blockprep-{spec.run_id}-{b}")
        for b, batch in enumerate(batches)
    ]  # fmt: skip
    done = as_completed(futures, loop=client.loop)
    try:
        while not interrupted.is_set() and not done.is_empty():
            ready = done.next_batch(block=False)
            if not ready:
                interrupted.wait(POLL_S)
            for future in ready:
                statuses = future.result()
                if sink is not None:
                    sink(statuses)
                if progress:
                    progress(len(statuses), len(todo))
        if interrupted.is_set():
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        interrupted.set()
        _stop_after_interrupt(client, futures, pids or [])
        raise
    except (OSError, PrepError):
        client.cancel(futures)
        raise
    except Exception as exc:
        client.cancel(futures)
        if type(exc).__name__ == "KilledWorker":
            raise PrepError(f"{spec.output}: a dask worker died repeatedly ({exc}); re-run to resume") from None
        raise


def worker_mode(
    workers: int, n_todo: int, item_s: float | None, head: list[Any], cuda_initialized: bool,
    processes: bool | None = None, forkserver_s: float | None = None,
) -> bool:  # fmt: skip
    """Processes (True) or threads for a local run: `processes` as asked, or (None) as choose_processes
    decides; threads for a head that touches CUDA (`loaders.cache.chain.touches_cuda(head)`) or a process where CUDA
    is initialised (`cuda_initialized`: what `torch.cuda.is_initialized()` says). `forkserver_s`: seconds the
    forkserver still needs for its imports (default: `prep.processes.seconds_to_ready()`), added to the start."""
    if processes is not None:
        return processes
    cuda = cuda_initialized or chain.touches_cuda(head)
    wait = seconds_to_ready() if forkserver_s is None else forkserver_s
    return choose_processes(workers, n_todo, item_s, cuda, PROCESS_START_S + wait)
