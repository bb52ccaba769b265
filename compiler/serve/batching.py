"""How a batcher forms its next batch: the one policy of ``DynamicBatcher`` and ``ProcessBatcher``.

A batcher's queue holds its requests in the order they are served: high priority first (``DynamicBatcher``'s
``priority=True``), then oldest first. ``BatchPolicy.ready`` says when the queue makes a batch: once it holds
``max_batch`` rows, or its first request has waited ``max_wait`` seconds (the window). A queue whose batch would be
padded (its rows fill no bucket exactly, so it would cost the GPU what the next bucket's full batch costs) waits
while the batcher's last batch runs, and its window counts from that batch's answers: started now it would only
queue behind the running batch, while the callers that batch answers can still join it (64 client threads on one
ONNX Runtime context with one bucket otherwise split into two halves that each paid a whole bucket).
``BatchPolicy.take`` then picks the batch:

1. requests past their deadline expire: they are answered with ``RequestTimeout`` and never run;
2. of the rest, only those whose signature equals the first's share the batch (equal non-batch sizes: two
   sequence lengths make two batches);
3. first fit: in queue order, each of those whose rows still fit in ``max_batch`` (the first always, even one of
   more rows), until the batch is full; a request that does not fit leaves room for later, smaller ones.

The queue is given as arrays, one entry per request, as the process batcher holds its queue: choosing a batch
costs a few numpy calls per batch and no Python per request (the process batcher's one thread is the limit of a
server on a fast GPU). The policy holds no requests itself: each batcher keeps its queue, its lock and its answers.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from compiler.core.errors import InputError

log = logging.getLogger(__name__)

__all__ = ["BatchPolicy", "Taken", "check_settings", "first_fit", "is_ready"]


def check_settings(max_batch: int | None, max_wait_ms: float, timeout: float | None) -> None:
    """Refuse settings no batcher can serve by: ``max_batch`` below 1, a negative window, a timeout of 0 or less."""
    if max_batch is not None and max_batch < 1:
        raise InputError(f"max_batch={max_batch}: a batch holds at least one row")
    if max_wait_ms < 0:
        raise InputError(f"max_wait_ms={max_wait_ms} must not be negative")
    if timeout is not None and timeout <= 0:
        raise InputError(f"timeout={timeout} must be positive (or None to wait forever)")


class Taken(NamedTuple):
    """What ``BatchPolicy.take`` chose, as indices and a mask into the queue it was given."""

    batch: np.ndarray  # int64 indices of the batch's requests, in queue order
    rows: int  # the batch's rows in all
    expired: np.ndarray  # int64 indices of the requests past their deadline (answer them with a timeout)
    left: np.ndarray  # bool mask of the requests still queued, for a later batch


_NONE = np.empty(0, np.int64)
_NONE.flags.writeable = False


@dataclass(frozen=True)
class BatchPolicy:
    """When a batch is ready and which requests it takes (the module docstring): ``max_batch`` rows at most,
    ``max_wait`` seconds (the window) that the queue's first request waits for company."""

    max_batch: int
    max_wait: float
    buckets: tuple[int, ...] = ()  # the engines' batch sizes: a queue of other sizes is padded (none: never)

    @staticmethod
    def of(buckets: Sequence[int], max_batch: int | None, max_wait_ms: float, timeout: float | None) -> BatchPolicy:
        """The policy of a batcher's settings, checked (``check_settings``); ``max_batch`` None: the largest bucket."""
        check_settings(max_batch, max_wait_ms, timeout)
        return BatchPolicy(max_batch or max(buckets), max_wait_ms / 1000.0, tuple(sorted(buckets)))

    def padded(self, queued_rows: int) -> bool:
        """Whether a batch of ``queued_rows`` rows would be padded: below ``max_batch`` and no bucket's size."""
        return bool(self.buckets) and queued_rows < self.max_batch and queued_rows not in self.buckets

    def window_end(self, first_submitted: float, answered: float = float("-inf"), padded: bool = False) -> float:
        """When the window of a queue whose first request came at ``first_submitted`` (monotonic seconds) ends; for a
        padded queue, counted from the last batch's answers (``answered``) when those came later."""
        return (max(first_submitted, answered) if padded else first_submitted) + self.max_wait

    def ready(self, queued_rows: int, first_submitted: float, now: float, *, running: bool = False,
              answered: float = float("-inf")) -> bool:
        """Whether a queue of ``queued_rows`` rows makes a batch at ``now``: it is full, or its window is over; a
        padded queue not while a batch is ``running``, its window from the last batch's ``answered`` time (the
        module docstring). Without ``running`` and ``answered``: full, or its window over."""
        if queued_rows >= self.max_batch:
            return True
        padded = self.padded(queued_rows)
        if padded and running:
            return False
        return now >= self.window_end(first_submitted, answered, padded)

    def take(self, rows: np.ndarray, signatures: np.ndarray, deadlines: np.ndarray, now: float) -> Taken:
        """Choose one batch from a queue: ``rows`` (int64 per request), ``signatures`` (int64, one row per request:
        equal rows for requests that may share a batch; no columns when all may), ``deadlines`` (monotonic seconds)
        at ``now``. The batch is empty when every request expired. Decides only: answering, running and requeueing
        are the caller's.

        A batch taken from the first requests of a queue that comes out full (``max_batch`` rows) is the batch of
        the whole queue, as first fit stops once the batch is full: a caller whose queue is costly to convert may
        give the first ``max_batch`` requests, and the whole queue only when their batch is not full."""
        expired = deadlines < now
        if expired.any():
            live = np.flatnonzero(~expired)
            gone = np.flatnonzero(expired)
            if not len(live):
                return Taken(_NONE, 0, gone, ~expired)
            alike = live[_like_first(signatures[live])]
        elif len(rows):
            gone = _NONE
            alike = np.flatnonzero(_like_first(signatures))
        else:
            return Taken(_NONE, 0, _NONE, ~expired)
        chosen, total = first_fit(rows[alike], self.max_batch)
        batch = alike[chosen]
        left = ~expired
        left[batch] = False
        return Taken(batch, total, gone, left)


def _like_first(signatures: np.ndarray) -> np.ndarray:
    """A bool per row of ``signatures``: whether it equals the first row."""
    if signatures.shape[1] == 1:  # the common cases, quicker than a reduction over the columns
        return signatures[:, 0] == signatures[0, 0]
    if signatures.shape[1] == 0:
        return np.ones(len(signatures), bool)
    return (signatures == signatures[0]).all(axis=1)


def first_fit(rows: np.ndarray, max_batch: int) -> tuple[np.ndarray | slice, int]:
    """The requests of one batch, as an index into ``rows`` (a slice for single-row requests, the common case), and
    its rows in all: in order, each request whose rows fit beside those taken before it (the first always, even one
    over ``max_batch``), until ``max_batch`` rows are taken."""
    if (rows == 1).all():
        n = min(len(rows), max_batch)
        return slice(0, n), n
    taken: list[int] = []
    total = 0
    for index, n in enumerate(rows.tolist()):
        if total >= max_batch:
            break
        if total + n <= max_batch or not taken:
            taken.append(index)
            total += n
    return np.asarray(taken, np.int64), total


def is_ready(finish: Callable[..., Any]) -> bool:
    """Whether a started batch (``Engines.start_parts``) is done; True for engines that do not say."""
    ready = getattr(finish, "ready", None)
    return True if ready is None else bool(ready())


def warn_of_split_batches(buckets: Sequence[int], workers: int, name: str) -> None:
    """Say once, at a batcher's start, that several workers on engines of one padded bucket cost throughput: each
    waits only for its own last batch, so they split the requests that arrive together into smaller batches that
    each cost a full one (on an H200 host, 64 threads on two workers got 38-60 rows a batch and 47-48 % of the
    bound, against 52 % with one)."""
    if workers > 1 and len(buckets) == 1 and buckets[0] > 1:
        log.warning("%s run every batch at %d rows, padded: %d workers split the requests that arrive together into "
                    "smaller batches that each cost a full one. Use workers=1 (the default), which keeps two batches "
                    "in flight on a GPU", name, buckets[0], workers)


class ThreadedCallers:
    """Says once that many threads block in a batcher's ``submit``: one process's GIL serializes their answers and
    their next requests (about 60 us of Python work each on an H200 host), so single rows from 64 threads reach
    52-69 % of ``engines(x)`` at batch 64 on torchvision's ResNet-50 there, where ProcessBatcher and coroutines
    reach 118 % and more (docs/benchmarks.md, "Serving at its bound"). ``saw`` costs a set insertion until then."""

    def __init__(self, max_batch: int, name: str) -> None:
        self._threads: set[int] | None = set()
        self._limit, self._name = max(8, max_batch // 2), name
        self._said = threading.Lock()  # taken once, by the thread that reaches the limit first

    def saw(self) -> None:
        """Count the calling thread; at ``max_batch / 2`` threads (8 at least), warn and stop counting."""
        threads = self._threads  # one read: another caller may drop the set meanwhile
        if threads is None:
            return
        threads.add(threading.get_ident())
        if len(threads) >= self._limit and self._said.acquire(blocking=False):
            self._threads = None
            log.warning("%d or more threads block in submit on %s: one process's GIL serializes every answer and next "
                        "request, which costs about half the throughput of a full batch. Serve them through "
                        "ProcessBatcher (compiler.serve.processes), or from coroutines awaiting infer",
                        self._limit, self._name)
