"""Imported last by `prep cache`'s forkserver (`prep.processes.PRELOAD`): its objects frozen before any fork.

The objects the forkserver imported (torch, MONAI, distributed) lie in pages its forked worker processes share
copy-on-write. A worker's first full garbage collection walks every one of them and writes their headers, so
the worker copies those pages and spends CPU on objects that never become garbage. `gc.freeze()` takes them
out of the collector's reach in every process forked afterwards.
"""

import gc

gc.collect()
gc.freeze()
