"""The loaders' tunables in one place, each with what it means and why it has its value (the measurements
behind them are in docs/benchmarks.md). The modules that use one import it by name from here, so a test or
an experiment may still set it on the module that uses it.
"""

from __future__ import annotations

import os

# --- Reading a prepared cache (loaders.reading.reads, loaders.reading.region, loaders.faces.dataset) ---

# Requests of an item read alone are cut into pieces of at least this many bytes when the item has fewer
# tensors than the backend has threads: a warm read is a memory copy, and one core copies ~10 GB/s.
SPLIT_BYTES = 2 << 20
# An item read alone up to this size goes through `Backend.read_small` (on the calling thread for posix, and
# for direct when warm): handing a few KB to the pool and waiting for it costs more than the copy itself.
INLINE_BYTES = 256 << 10
# Items whose entries are kept (immutable for a committed cache); beyond it the memo restarts.
PLAN_CACHE = 1 << 16

# Cost model for choosing the cut axis: a request costs about this many seconds of overhead (syscall,
# queueing), bytes cost 1/bandwidth. Warm page-cache numbers; cold NVMe favours fewer, bigger requests too.
REQUEST_COST_S = 10e-6
BANDWIDTH_BPS = 5e9
# Warm regions smaller than this are read in the calling thread, run after run: a handoff costs more.
SEQUENTIAL_BELOW = 1 << 20
# Requests in flight for cold region reads, each on its own thread (a device queue wants many; on a small
# machine the threads' Python overhead costs more than they hide): at most this, and 8 per core.
COLD_INFLIGHT = 64

# A pinned staging slot (`loaders.reading.staging.PinnedStager`) is pinned up to this size; a batch of whole
# items larger than it is staged in pageable memory and copied up synchronously on the read path. Pinning runs
# at about 1.6 GB/s on a GPU box and stalls the process's other CUDA calls meanwhile (256 MB: 0.15 s), where a
# pageable copy runs at 5 GB/s: the `slices` batches of 1.1 GB, three slots pinned while the first batch was made,
# took that batch 3.2-3.6 s against 0.16 from pinned memory torch had cached (docs/benchmarks.md).
PIN_MAX_BYTES = 128 << 20

# `PreparedDataset[i]`: tensors up to this size get their own storage when read (MONAI deep-copies a view's
# whole storage, the item's read buffer).
SMALL_OWN = 1 << 20


# --- Moving bytes (loaders.backends, loaders.reading.files, loaders.blockmap.fiemap) ---

# `direct` reads data already in the page cache buffered, in pieces of this size (one per thread of its pool).
WARM_CHUNK = 8 << 20

# Whole-file reads hint at most this many bytes to the kernel at a time (WILLNEED): large files do not flood
# the page cache.
HINT_BYTES = 64 << 20
# Files read_whole_files holds open at a time: bounded, so a large batch never nears the process's descriptor
# limit
OPEN_AT_ONCE = 64

# Extents asked for per FIEMAP ioctl: one call covers nearly every file; bigger ones page through.
DEFAULT_BATCH = 32


# --- The feeder (loaders.fast.trial) ---

# feeder="auto" compares the training loop's period with the batches made in process (the latest TRIAL_WINDOW
# periods) and fed by the child (TRIAL_LEAST periods after its first whole epoch, its tier then filled); the
# batches come back to the training process where the fed period is longer by more than TRIAL_MARGIN (a second
# CUDA context time-sliced against the training's can cost more than the Python it takes off: docs/loaders.md)
TRIAL_WINDOW = 64
TRIAL_LEAST = 16
TRIAL_MARGIN = 0.03
# A host feeder's child tried after the first child (HOST_FEED "auto"): its first TRIAL_SKIP periods left out (its
# tail's graphs captured in the training process, its shared memory made), then TRIAL_LEAST counted
TRIAL_SKIP = 4
# The device tier filled while the child started is lent to it through CUDA IPC (no second fill, and nothing to
# fill again if the batches come back) when it holds at most this many tensors: each is a handle sent and opened
# (a dataset of many small items, MedNIST's 10,240 images, gives its tier up and the child fills its own)
TIER_SHARE_TENSORS = 4096


# --- The random tail (loaders.tail) ---

# Batches of a costly random transform's draws (RandGaussianNoised) made ahead on a thread: DEPTH at least, and
# more where their expected bytes allow, AHEAD_BYTES in all, up to AHEAD_MOST. One thread draws one stream in order;
# where its draws take about a step's time, the count of items a batch fires on varies, and a shallow queue leaves
# the thread idle behind a light batch and the training waiting behind a heavy one (docs/benchmarks.md)
DEPTH = 2
AHEAD_MOST = 16
AHEAD_BYTES = 256 << 20
# In a feeder's process (`loaders.fast.child`), a batch's tail launches its batched transforms' kernels as CUDA
# graphs (`loaders.tail.graphs`): the same kernels, about a third of their cost to the training step in the other
# process (time-sliced contexts). In the training process itself they would cost their capture and gain nothing
# (one context: no time slicing), and the first batch, made there while the feeder starts, measured 0.3-0.8 s
# without them and 0.8-1.1 s with them (docs/benchmarks.md). BLOCKPREP_TAIL_GRAPHS=0 in the environment (which
# the feeder's process inherits) launches them one by one there too; =1 captures them in any process.
TAIL_GRAPHS = {"0": False, "1": True}.get(os.environ.get("BLOCKPREP_TAIL_GRAPHS", ""), "feeder")
# A tail whose every transform has a plan (`loaders.tail.plans`: draws on the host, the work from them with the same
# kernels for every batch of a kind) or runs eagerly between them keeping its entries' shapes and dtypes, on a CUDA
# device, can be replayed: its planned transforms as graphs captured once per kind (`loaders.tail.replay`), a batch
# costing the host its draws, a launch a planned transform and the eager ones' Python where they fire. Not by
# default: made in the training process it has not beaten the batched versions there in the training benchmark yet,
# and its first captures delay the first batch (docs/benchmarks.md). BLOCKPREP_TAIL_REPLAY=here in the environment
# replays in the training process (not in a feeder's child); =1 in any process.
TAIL_REPLAY = {"1": True, "here": "here"}.get(os.environ.get("BLOCKPREP_TAIL_REPLAY", ""), False)
# A feeder's child that never touches CUDA (`loaders.fast.hostfeed`): it reads, crops and stacks each batch on the
# CPU and makes its tail's draws alone; the training process copies the batch up from page-locked shared memory and
# replays the tail's work from those draws (a tail some transform of which has no plan, or runs eagerly, runs on the
# child's CPU instead). One CUDA context, not two. By default ("chosen"), feeder="auto" on a GPU starts a host
# feeder where the first batch made in the training process shows its tail drawable (`BatchedTail.drawable`) and
# the training loop's period with the batches made there is at least HOST_FEED_PERIOD (the median of the latest
# HOST_FEED_LOOK periods of its second epoch made there, or of HOST_FEED_FIRST periods of its first, which the
# device tier's filling and the tail's first captures lengthen); else a child with a CUDA context. A host feeder's
# replays and takes cost the training process 3-4 ms a step, which a long step hides and a short one pays (H200,
# one call each: `seg-elastic` 0.85-0.89 of the ceiling against 0.77-0.84 with a CUDA child, `seg-ct` 0.95-0.96
# against 0.93, `seg-aug` 0.88 both; `spheres`, 8-10 ms a step made here, 0.72-0.76 against 0.83-0.88; the loop's
# period made here, the trial's: `spheres` 6.0-10.4 ms, `seg-aug` and `seg-elastic` 30-32, `seg-ct` 48-51).
# BLOCKPREP_HOST_FEED=1: every feeder a host feeder; =0: none; =auto: feeder="auto" tries one after the first child
# and keeps the faster (`loaders.fast.trial`).
_HOST_FEEDS: dict[str, bool | str] = {"1": True, "0": False, "auto": "auto"}
HOST_FEED: bool | str = _HOST_FEEDS.get(os.environ.get("BLOCKPREP_HOST_FEED", ""), "chosen")
HOST_FEED_PERIOD = 0.020
HOST_FEED_LOOK = 8
HOST_FEED_FIRST = 64
# A host feeder's batches on a GPU are taken in the training process on a thread of the loader's
# (`loaders.fast.hostfeed.Taker`: the message, the copies up and the tail's launches while the training thread waits
# for its step's kernels), one ahead and just in time. BLOCKPREP_HOST_TAKE_THREAD=0 in the environment takes each on the
# training thread as it is asked for (and the next where it has come); =1 on a thread for a loader on the CPU too.
HOST_TAKE_THREAD = {"0": False, "1": True}.get(os.environ.get("BLOCKPREP_HOST_TAKE_THREAD", ""), "gpu")
# How long before the caller's next `next` that thread aims to have its take done, in ms: a number, fixed (3 by
# default); "auto", from 3 ms down by a quarter of a ms each batch ready in time and up by one each batch the caller
# waited for (it settles where one batch in five is late: on the H200, `seg-elastic` 0.86-0.87 of the ceiling with
# it against 0.88-0.89 with 3 ms fixed, over two rounds of one call). BLOCKPREP_HOST_TAKE_MARGIN in the environment
# sets it.
HOST_TAKE_MARGIN: float | str = (lambda v: "auto" if v == "auto" else float(v or 3))(
    os.environ.get("BLOCKPREP_HOST_TAKE_MARGIN", "")
)
# Where numpy's uniform numbers a transform draws by the million (`Rand3DElasticd`'s offsets) are made from the
# generator's state on the CUDA device that uses them (`loaders.tail.uniforms`: cupy's compiler, the kernel checked
# once a process against numpy): "auto" where the tail runs in the training process; "1" also where a host
# feeder's child describes them for it (a third of the child's CPU time on `seg-elastic`, but 0.82 of the ceiling
# against 0.88 drawn in the child, one call: docs/benchmarks.md) and in a feeder's child with a CUDA context of its
# own; "0" never (drawn on the host).
DEVICE_DRAWS = {"0": False, "1": True}.get(os.environ.get("BLOCKPREP_DEVICE_DRAWS", ""), "auto")
# In a replayed tail, batches of at most this many items have a graph per count of the items a costly transform
# fires on (n + 1 each, captured as they first come; the rows picked on the device from the mask), its work on those
# items alone, as its batched version runs it; larger batches compute every item and keep the fired ones by a mask
# (more GPU work in the one graph). A graph per pattern of rows, before, was 2**n of them: 96 of the 150 graphs a
# replayed `seg-aug` captured over its first 120 batches, against 30 a count. On
# the fired rows alone `seg-aug`'s replayed tail cost its step about half what the masks did. RandAffined's grids are
# MONAI's (its products with the identity grid drawn described and made at once on the device where shown to give
# the host's numbers there, else on the host: `loaders.tail.products`), and on the
# fired rows alone its resample, the elastic's and the intensity plans' are MONAI's bit for bit on the H200
# (tests/loaders/test_tail_replay.py, -m gpu; docs/benchmarks.md). BLOCKPREP_TAIL_PATTERNS=N in the environment
# sets it (0: every batch by the mask).
TAIL_PATTERNS = int(os.environ.get("BLOCKPREP_TAIL_PATTERNS", "") or 8)
# In a replayed tail, RandGaussianSharpend (MONAI's "erf" kernels) and RandCoarseDropoutd (holes of one size) run
# item by item as graphs, one for each set of the kernels' lengths or the holes' shapes, instead of eagerly between
# the graphs: their eager work was 44% and 10% of a host-fed `seg-aug` batch's taking in the training process
# (py-spy, H200; docs/benchmarks.md). BLOCKPREP_ITEMS_GRAPHED=0 in the environment runs them eagerly.
ITEMS_GRAPHED = os.environ.get("BLOCKPREP_ITEMS_GRAPHED", "") != "0"
# In a feeder's child, a batch is copied into its hand-over slot on the tail thread right after its tail's work is
# queued, so that both reach the GPU as one arrival (each arrival of the child's work is a turn of its context on
# the GPU: docs/benchmarks.md), not at the parent's credit from the main thread. BLOCKPREP_PACK_AHEAD=0 in the
# environment packs it there.
PACK_AHEAD = os.environ.get("BLOCKPREP_PACK_AHEAD", "") != "0"
# In a feeder's child, the next batch's first capture is opened as soon as this batch's work is queued, and that
# batch's assembly (its rows stacked from the device tier) is captured into it: the two small kernels a capture's
# start launches go with this batch's work, and the next batch's work reaches the GPU as one graph
# (`loaders.tail.graphs.Graphs.open_ahead`). BLOCKPREP_CAPTURE_AHEAD=0 in the environment opens each where it is.
CAPTURE_AHEAD = os.environ.get("BLOCKPREP_CAPTURE_AHEAD", "") != "0"
# A feeder's child that fails says one line to the training process, which raises it; BLOCKPREP_FEEDER_TRACE=1 in the
# environment also prints the child's whole traceback to its standard error (where the error came from).
FEEDER_TRACE = os.environ.get("BLOCKPREP_FEEDER_TRACE", "") == "1"


# --- DALI sources (loaders.faces.dali, loaders.faces.dali_base, loaders.faces.dali_bmap) ---

# Batches past the one read ahead whose files FileSource hints to the kernel (posix_fadvise WILLNEED) when they are
# cold: the kernel reads them asynchronously, so the disk has more requests in flight than the read threads make
HINT_BATCHES = 6
# A warm batch is read ahead on a thread where the consumer spends more than this many times a batch's read between
# two batches (a pipeline that decodes: the reads then overlap the pipeline's wait); where it comes back at once,
# reading ahead on a thread loses to reading when asked (docs/benchmarks.md, DALI sources)
IDLE_READS = 2.0

# FileSource's read threads for a batch whose first file is not in the page cache (cold data) where io_uring cannot
# be used: its one warm-data thread read a cold tree well under fn.readers.file (docs/benchmarks.md, DALI sources)
COLD_READ_THREADS = 8
# FileSource's io_uring reads (`loaders.reading.uring`): in a cold epoch up to URING_BATCHES batches are in flight,
# at most URING_FILES files (each holds a descriptor while in flight); a batch of more files is read with plain reads
URING_BATCHES = 4
URING_FILES = 256

# BmapSource's cold epochs: up to this many batches read ahead, one after another on the read-ahead thread (each
# batch's device ranges in parallel), at most about HINT_BYTES: more than one batch ahead reads cold epochs much
# faster than one (docs/benchmarks.md, DALI sources)
BMAP_COLD_BATCHES = 3
# ... on this many threads, so two batches are read at once: each waits on the disk and, on a VM whose balloon
# reports free pages to the host, on the first touch of the page-cache pages its reads fill; two threads overlap
# those waits, most where the first touches are slow (docs/benchmarks.md, DALI sources)
BMAP_COLD_THREADS = 2
# After a batch found not in the page cache, BmapSource asks again at every this many-th batch only: on cold data
# opening the two files to ask waits for their inodes (docs/benchmarks.md, DALI sources)
MEMORY_PROBES_AFTER_MISS = 16
# The most DDP ranks a reader is sharded over: a rank's order is padded to the world size, so a world of 10^12
# would ask for terabytes (a bare MemoryError); a million ranks is far past any machine room
MAX_WORLD_SIZE = 1 << 20

# A file whose ctime is less than this before its full freshness check is checked in full (written back, fstat,
# FIEMAP) on every read call, never by the one-lstat shortcut: a write in the same timestamp tick as that check
# (1-10 ms coarse clocks) leaves ctime as it was, its new bytes only in the page cache (loaders.backends.mapped)
RECENT_CTIME_S = 1.0
