"""A dynamic batcher for servers: many small requests in, bucket-sized batches to the engines.

Requests queue until the oldest has waited ``max_wait_ms`` (default 10) or ``max_batch`` rows
(default: the largest bucket) are waiting; then the batcher packs them into one batch (the
engines pad it to the smallest bucket that holds it), runs it, and hands every caller its own
rows back. A request that is still queued after its timeout fails with ``RequestTimeout``
instead of waiting forever. High-priority requests (``priority=True``) go first into every batch.

Only requests whose non-batch shapes and dtypes agree are packed together (two sequence lengths
make two batches). Requests are checked when submitted, so a bad request fails its own caller
at once and never a batch of others.

Each worker packs numpy requests into a buffer of its own, reused from batch to batch: a fresh
array per batch (38 MB for 64 ResNet-50 images) costs page faults and a second pass over the
data with the GIL held, while the engines copy the batch into their own (pinned) buffers before
they return anyway.

    batcher = DynamicBatcher(compiler.load("build/m"), max_wait_ms=5)
    y = batcher.submit(x, timeout=0.5)          # blocking
    future = batcher.submit_async(x)            # concurrent.futures.Future
    batcher.close()
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from compiler.core.errors import InputError
from compiler.core.specs import BATCH_DIM, ModelSpec

__all__ = ["DynamicBatcher", "RequestTimeout", "BatcherClosed"]

log = logging.getLogger(__name__)


class RequestTimeout(TimeoutError):
    """A request was not answered within its timeout (the server is overloaded or stuck)."""


class BatcherClosed(RuntimeError):
    """The batcher was closed before the request ran."""


class _Engines(Protocol):
    """What the batcher needs of ``compiler.serve.engines.Engines``."""

    buckets: tuple[int, ...]
    input_names: list[str]
    output_names: list[str]
    spec: ModelSpec

    def check(self, x: Any) -> Any: ...

    def __call__(self, x: Any) -> Any: ...


@dataclass
class _Request:
    feed: dict[str, Any]
    single: bool  # submitted as one array: answered with one array when the model has one output
    rows: int
    signature: tuple[Any, ...]  # requests with equal signatures can share a batch
    deadline: float  # time.monotonic() after which it fails
    timeout: float
    submitted: float
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


class DynamicBatcher:
    """Packs concurrent requests into batches for ``engines``; thread-safe.

    ``max_batch``: rows per batch (default: the largest bucket). ``max_wait_ms``: how long the
    oldest request waits for company. ``timeout``: seconds a request may wait before it fails
    (default 10; per request with ``submit(..., timeout=)``; None waits forever). ``workers``:
    threads forming and running batches (give the engines at least as many contexts).
    """

    def __init__(self, engines: _Engines, *, max_batch: int | None = None, max_wait_ms: float = 10.0,
                 timeout: float | None = 10.0, workers: int = 1) -> None:
        if max_batch is not None and max_batch < 1:
            raise InputError(f"max_batch={max_batch}: a batch holds at least one row")
        if max_wait_ms < 0:
            raise InputError(f"max_wait_ms={max_wait_ms} must not be negative")
        if timeout is not None and timeout <= 0:
            raise InputError(f"timeout={timeout} must be positive (or None to wait forever)")
        if workers < 1:
            raise InputError(f"workers={workers}: the batcher needs at least one worker")
        self.engines = engines
        self._unbatched = {i.name for i in engines.spec.inputs if not i.dims or i.dims[0] != BATCH_DIM}
        self.max_batch = max_batch or max(engines.buckets)
        self.max_wait = max_wait_ms / 1000.0
        self.timeout = timeout
        self._lanes: tuple[collections.deque[_Request], collections.deque[_Request]] = (
            collections.deque(), collections.deque())  # high priority, normal
        self._cond = threading.Condition()
        self._queued = 0  # rows waiting in the lanes
        self._closed = False
        self._drain = True
        self._scratch = threading.local()  # per worker: input name -> reusable flat array
        self._threads = [threading.Thread(target=self._work, name=f"trtc-batcher-{i}", daemon=True)
                         for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def __enter__(self) -> DynamicBatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the callers' side --

    def submit_async(self, x: Any, *, timeout: float | None = None, priority: bool = False,
                     ) -> concurrent.futures.Future[Any]:
        """Queue one request (an array or a dict by input name, batch first); its result arrives in the Future.

        Raises ``FeedError`` at once for a request that does not fit the model. The Future fails
        with ``RequestTimeout`` when the request is still queued after ``timeout`` seconds (the
        batcher's default when None), with ``BatcherClosed`` when the batcher closes first.
        """
        if timeout is not None and timeout <= 0:
            raise InputError(f"timeout={timeout} must be positive")
        single = not isinstance(x, Mapping)
        checked = self.engines.check(x)
        feed = {self.engines.input_names[0]: x} if single else dict(x)
        limit = self.timeout if timeout is None else timeout
        now = time.monotonic()
        request = _Request(feed, single, checked.rows, _signature(feed, self._unbatched),
                           now + limit if limit is not None else float("inf"), limit or 0.0, now)
        with self._cond:
            if self._closed:
                raise BatcherClosed("the batcher is closed; make a new one")
            was_empty = not (self._lanes[0] or self._lanes[1])
            self._lanes[0 if priority else 1].append(request)
            self._queued += request.rows
            # wake a worker only when it has something new to do: a window to start, or a full batch. A wake-up per
            # request (64 per batch of single requests) made the workers fight the submitting threads for the GIL.
            if was_empty or self._queued - request.rows < self.max_batch <= self._queued:
                self._cond.notify()
        return request.future

    def submit(self, x: Any, *, timeout: float | None = None, priority: bool = False) -> Any:
        """Run one request through the batcher and return its outputs; blocks at most ``timeout`` seconds.

        Raises ``RequestTimeout`` when the answer does not come in time (the request is then
        dropped if it has not started), ``FeedError`` for a request that does not fit the model.
        """
        future = self.submit_async(x, timeout=timeout, priority=priority)
        limit = self.timeout if timeout is None else timeout
        try:
            return future.result(timeout=limit)
        except RequestTimeout:
            raise
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise RequestTimeout(f"no answer within {(limit or 0) * 1000:.0f} ms: the server is overloaded; raise the "
                                 "timeout, or add contexts, workers or GPUs") from None

    def close(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop taking requests; run the queued ones (``drain``) or fail them with ``BatcherClosed``."""
        with self._cond:
            self._closed = True
            self._drain = drain
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=timeout)
            if thread.is_alive():
                log.warning("batcher worker %s did not stop within %.0f s", thread.name, timeout)

    # -- the workers' side --

    def _work(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            if batch:
                self._run(batch)

    def _next_batch(self) -> list[_Request] | None:
        """Wait for requests and take one batch of them; None when closed and empty."""
        high, normal = self._lanes
        with self._cond:
            while not (high or normal):
                if self._closed:
                    return None
                self._cond.wait()
            if self._closed and not self._drain:
                for lane in self._lanes:
                    while lane:
                        _fail(lane.popleft(), BatcherClosed("the batcher was closed before this request ran"))
                self._queued = 0
                return None
            first = high[0] if high else normal[0]
            window_end = first.submitted + self.max_wait
            while not self._closed and self._queued < self.max_batch:
                left = window_end - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            batch = self._take()
            self._queued = sum(r.rows for lane in self._lanes for r in lane)
            if self._queued:
                self._cond.notify()  # what is left is another worker's next batch
            return batch

    def _take(self) -> list[_Request]:
        """Pop the requests of one batch (high lane first), failing the expired ones on the way."""
        now = time.monotonic()
        batch: list[_Request] = []
        rows = 0
        signature = None
        for lane in self._lanes:
            kept: list[_Request] = []
            while lane:
                request = lane.popleft()
                if request.deadline < now:
                    _fail(request, RequestTimeout(
                        f"the request waited {(now - request.submitted) * 1000:.0f} ms in the queue, over its timeout "
                        f"of {request.timeout * 1000:.0f} ms: the server is overloaded; raise the timeout, or add "
                        "contexts, workers or GPUs"))
                    continue
                if signature is None:
                    signature = request.signature
                fits = request.signature == signature and (rows + request.rows <= self.max_batch or not batch)
                if not fits:
                    kept.append(request)
                    if rows >= self.max_batch:
                        break
                    continue
                if not request.future.set_running_or_notify_cancel():
                    continue  # its caller gave up (submit's timeout)
                batch.append(request)
                rows += request.rows
            lane.extendleft(reversed(kept))
        return batch

    def _run(self, batch: list[_Request]) -> None:
        try:
            if len(batch) == 1:
                feed = batch[0].feed
            else:
                feed = {name: batch[0].feed[name] if name in self._unbatched else
                        self._pack(name, [r.feed[name] for r in batch]) for name in self.engines.input_names}
            outputs = self.engines(feed)
        except BaseException as err:  # every caller of the batch learns why; the worker keeps serving
            for request in batch:
                request.future.set_exception(err)
            if not isinstance(err, Exception):
                raise
            return
        names = self.engines.output_names
        offset = 0
        for request in batch:
            part = {name: outputs[name][offset:offset + request.rows] for name in names}
            offset += request.rows
            request.future.set_result(part[names[0]] if request.single and len(names) == 1 else part)


    def _pack(self, name: str, parts: list[Any]) -> Any:
        """The parts of one input, one after the other along the batch, in this worker's reusable buffer."""
        if not isinstance(parts[0], np.ndarray):
            return _concatenate(parts)
        rows = sum(len(p) for p in parts)
        first = parts[0]
        shape = (rows, *first.shape[1:])
        size = int(np.prod(shape))
        buffers: dict[str, np.ndarray] = self._scratch.__dict__.setdefault("buffers", {})
        flat = buffers.get(name)
        if flat is None or flat.dtype != first.dtype or flat.size < size:
            flat = np.empty(max(size, int(np.prod((self.max_batch, *first.shape[1:])))), first.dtype)
            buffers[name] = flat
        out = flat[:size].reshape(shape)
        np.concatenate(parts, out=out)
        return out


def _fail(request: _Request, err: BaseException) -> None:
    if request.future.set_running_or_notify_cancel():
        request.future.set_exception(err)


def _signature(feed: dict[str, Any], unbatched: set[str]) -> tuple[Any, ...]:
    """What must agree for two requests to share a batch: array kind, device, dtype and non-batch shape.

    An input without a batch dimension is shared by the whole batch, so only requests passing the
    very same array for it are packed together.
    """
    return tuple((name, type(a).__name__, str(getattr(a, "device", "")), str(a.dtype),
                  id(a) if name in unbatched else tuple(a.shape[1:])) for name, a in sorted(feed.items()))


def _concatenate(parts: list[Any]) -> Any:
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    import torch

    return torch.cat(parts)
