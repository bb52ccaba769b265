"""Keeping the garbage collector's full collections off served requests: ``load`` moves the objects alive when it
starts out of the collector's view (``gc.freeze``) after one collection of its own.

A process that serves a model has imported torch and its friends, and often exported or built the model too:
about 460,000 objects tracked by the collector in ``benchmarks/serving_gpu.py`` on the H200 host. CPython's full
collection walks every one of them with the GIL held, 240-260 ms there, and it comes by itself every so often
as requests allocate: every thread of the process stops, and every client in flight waits a quarter of a second
(in one of sixteen runs of 128 coroutines on ``DynamicBatcher``: 274 ms against a p99 of 15 ms). Those objects live
as long as the process; frozen, they are still freed when their last reference goes, only a reference cycle among
them is never collected. Later full collections walk what was made after the load (the engines themselves
included, which are not frozen), a few milliseconds.

``load(..., freeze_gc=False)`` leaves the collector as it is; ``gc.unfreeze()`` gives the objects back to it.
"""

from __future__ import annotations

import gc
import logging
import threading
import time

__all__ = ["freeze_alive"]

log = logging.getLogger(__name__)

_lock = threading.Lock()


def freeze_alive() -> None:
    """Collect once, then freeze every object still alive (the module docstring); the collection first, so that
    no garbage of earlier work is frozen with them."""
    with _lock:
        started = time.perf_counter()
        gc.collect()
        gc.freeze()
        log.debug("froze %d objects out of the garbage collector's view in %.0f ms", gc.get_freeze_count(),
                  1e3 * (time.perf_counter() - started))
