"""Large host copies split over a few threads: packing a batch's parts into pinned staging (``pack``) and copying a
large output out of pinned memory (``copy_out``). numpy releases the GIL while it copies, so the parts run at once.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

__all__ = ["PACK_GROUP_BYTES", "PACK_THREADS", "pack", "copy_out", "in_parallel", "pool", "mark_pack_thread"]

PACK_GROUP_BYTES = 8 << 20  # a batch packed, or an output copied out, is split over threads in parts this large
PACK_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))
_pack_pool: ThreadPoolExecutor | None = None
_pack_pool_lock = threading.Lock()
_in_pack_thread = threading.local()


def pack(parts: list[np.ndarray], out: np.ndarray) -> None:
    """``np.concatenate(parts, out=out)``, by up to ``PACK_THREADS`` threads for large batches (numpy releases the
    GIL while it copies). numpy, not torch: ``torch.cat`` into pinned memory took 140-740 ms for 64 images on a
    busy 2-core host (its thread pool oversubscribed), numpy 6 ms; one thread alone was 2 ms slower per batch of
    64 ResNet images than torch on the H200."""
    groups = min(PACK_THREADS, len(parts), out.nbytes // PACK_GROUP_BYTES)
    if groups <= 1:
        np.concatenate(parts, out=out, casting="same_kind")
        return
    offsets = [0, *itertools.accumulate(len(p) for p in parts)]  # row offsets of the parts in ``out``
    cuts = [len(parts) * g // groups for g in range(groups + 1)]  # parts per thread, about equal
    in_parallel([functools.partial(np.concatenate, parts[a:b], out=out[offsets[a]:offsets[b]], casting="same_kind")
                  for a, b in itertools.pairwise(cuts)])


def copy_out(view: np.ndarray) -> np.ndarray:
    """``view.copy()``, by up to ``PACK_THREADS`` threads for a large output: the new array's pages are faulted in
    (and zeroed by the kernel) as they are first written. A segmenter's batch of 16 (67 MB out) took 19-21 ms with
    one thread and 12-13 ms with four on the H200's host; ``map`` 16-19 ms and 7.2-7.8 ms
    (``benchmarks/serving_gpu.py --models segmenter --map-only``)."""
    groups = min(PACK_THREADS, view.nbytes // PACK_GROUP_BYTES)
    if groups <= 1 or not view.flags.c_contiguous:
        return view.copy()
    out = np.empty_like(view)
    source, target = view.reshape(-1), out.reshape(-1)
    cuts = [len(source) * g // groups for g in range(groups + 1)]
    in_parallel([functools.partial(np.copyto, target[a:b], source[a:b]) for a, b in itertools.pairwise(cuts)])
    return out


def in_parallel(calls: list[Callable[[], Any]]) -> None:
    """Run ``calls`` on the pack threads and wait for them all (the first error, if any, is raised once every call has
    ended, so that none still writes the caller's buffers). In the calling thread, one after the other, where the pool
    cannot take them: the caller is one of its threads (waiting there for the pool could wait for itself), or the
    interpreter is shutting down (a server's daemon thread still answering)."""
    if getattr(_in_pack_thread, "yes", False):
        for call in calls:
            call()
        return
    jobs = []
    error: BaseException | None = None
    try:
        for call in calls:
            jobs.append(pool().submit(call))
    except RuntimeError as err:
        if "shutdown" not in str(err):  # "cannot schedule new futures after (interpreter) shutdown" is the one we take
            error = err
        else:
            try:
                for call in calls[len(jobs):]:
                    call()
            except BaseException as failed:
                error = failed
    for job in jobs:  # every part ends before an error is raised: none may still write the caller's buffers
        try:
            job.result()
        except BaseException as failed:
            error = error or failed
    if error is not None:
        raise error


def pool() -> ThreadPoolExecutor:
    """The threads that pack large batches and copy out large outputs (numpy releases the GIL while it copies)."""
    global _pack_pool
    with _pack_pool_lock:
        if _pack_pool is None:
            _pack_pool = ThreadPoolExecutor(PACK_THREADS, thread_name_prefix="trtc-pack",
                                            initializer=mark_pack_thread)
        return _pack_pool


def mark_pack_thread() -> None:
    """A pack thread's initializer: ``_in_parallel`` called from it runs its parts there."""
    _in_pack_thread.yes = True
