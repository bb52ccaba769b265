"""A dynamic batcher for servers: many small requests in, bucket-sized batches to the engines.

Requests queue until the oldest has waited ``max_wait_ms`` (default 10) or ``max_batch`` rows
(default: the largest bucket) are waiting; then the batcher packs them into one batch (the
engines pad it to the smallest bucket that holds it), runs it, and hands every caller its own
rows back. A request that is still queued after its timeout fails with ``RequestTimeout``
instead of waiting forever. High-priority requests (``priority=True``) go first into every batch.

Only requests whose non-batch shapes and dtypes agree are packed together (two sequence lengths
make two batches). Requests are checked when submitted, so a bad request fails its own caller
at once and never a batch of others. When a batch is ready and which requests it takes is
``compiler.serve.batching``'s policy, which the process batcher shares.

Requests are never packed into a batch array of their own: each request's rows are copied straight into the
(pinned) input buffers of the context that runs the batch (``Engines.run_parts``): one pass over the data, not two.

``submit`` blocks a thread per request; ``submit_async`` returns a ``concurrent.futures.Future``;
``await batcher.infer(x)`` serves asyncio servers: their requests wait as coroutines of one
event loop, and every answer of a batch reaches that loop in one ``call_soon_threadsafe``, so a
batch of 64 costs one wake-up of the loop instead of 64 thread switches.

    batcher = DynamicBatcher(compiler.load("build/m"), max_wait_ms=5)
    y = batcher.submit(x, timeout=0.5)          # blocking
    future = batcher.submit_async(x)            # concurrent.futures.Future
    y = await batcher.infer(x)                  # in a coroutine
    batcher.close()
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from compiler.backends.feeds import CheckedFeed, as_kind
from compiler.core import defaults
from compiler.core.errors import InputError
from compiler.core.specs import BATCH_DIM, ModelSpec
from compiler.serve import switching
from compiler.serve.batching import BatchPolicy, ThreadedCallers, warn_of_split_batches
from compiler.serve.waits import BatcherClosed, OverdueWaits, RequestTimeout

__all__ = ["DynamicBatcher"]

log = logging.getLogger(__name__)


class _Engines(Protocol):
    """What the batcher needs of ``compiler.serve.engines.Engines``."""

    buckets: tuple[int, ...]
    input_names: list[str]
    output_names: list[str]
    spec: ModelSpec

    def check(self, x: Any) -> CheckedFeed: ...

    @property
    def queues_on_gpu(self) -> bool: ...

    def start_parts(self, calls: Sequence[CheckedFeed], *, wait: bool = True) -> Callable[..., Any] | None: ...

    def __call__(self, x: Any) -> Any: ...


_OVERLOADED = "the server is overloaded; raise the timeout, or add contexts, workers or GPUs"


@dataclass
class _Request:
    call: CheckedFeed
    single: bool  # submitted as one array: answered with one array when the model has one output
    signature: tuple[Any, ...]  # requests with equal signatures can share a batch
    deadline: float  # time.monotonic() after which it fails
    timeout: float
    submitted: float
    future: Any  # a _Waiter (submit), a concurrent.futures.Future (submit_async) or an asyncio.Future of ``loop``
    loop: asyncio.AbstractEventLoop | None = None

    @property
    def rows(self) -> int:
        return self.call.rows

    def start(self) -> bool:
        """Claim the request for a batch; False when its caller gave up (cancelled the future)."""
        if self.loop is not None:
            return not self.future.done()  # read across threads: ``_settle`` checks again on the loop
        if type(self.future) is _Waiter:
            return not self.future.cancelled
        return bool(self.future.set_running_or_notify_cancel())


class _Waiter:
    """What a blocking ``submit`` waits on: a lock released once the answer is in. A Future costs a condition
    variable, two lock round trips and a fresh lock per wait: the GIL-held work of every request, times 64
    threads a batch."""

    __slots__ = ("_lock", "cancelled", "error", "value")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self.value: Any = None
        self.error: BaseException | None = None
        self.cancelled = False  # set by the caller that stopped waiting; the worker then drops the request

    def set(self, value: Any, error: BaseException | None) -> None:
        self.value, self.error = value, error
        self._lock.release()

    def wait(self, timeout: float | None) -> bool:
        return self._lock.acquire(timeout=-1 if timeout is None else timeout)


class _Answers:
    """The answers of one batch, handed out together by ``send``: waiters and thread futures are set there,
    asyncio futures in one call per event loop."""

    def __init__(self) -> None:
        self._threads: list[tuple[_Request, Any, BaseException | None]] = []
        self._by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any, BaseException | None]]] = {}

    def set(self, request: _Request, value: Any = None, error: BaseException | None = None) -> None:
        if request.loop is None:
            self._threads.append((request, value, error))
        else:
            self._by_loop.setdefault(request.loop, []).append((request.future, value, error))

    def fail(self, request: _Request, error: BaseException) -> None:
        """Fail a request not yet claimed for a batch (unless its caller gave up)."""
        if request.start():
            self.set(request, error=error)

    def send(self) -> None:
        for request, value, error in self._threads:
            if type(request.future) is _Waiter:
                request.future.set(value, error)
            else:
                _resolve(request.future, value, error)
        self._threads.clear()
        for loop, items in self._by_loop.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for these
                loop.call_soon_threadsafe(_settle, items)
        self._by_loop.clear()


def _settle(items: list[tuple[Any, Any, BaseException | None]]) -> None:
    """On the event loop: set each asyncio future that is still waiting."""
    for future, value, error in items:
        if not future.done():  # done: cancelled by its caller, or timed out, meanwhile
            _resolve(future, value, error)


def _resolve(future: Any, value: Any, error: BaseException | None) -> None:
    """Set a future (concurrent or asyncio) to its answer or its error."""
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)


_SET_RETRY = 0.05  # seconds a worker whose answering thread holds a buffer set waits for it before it looks again


class _InFlight:
    """One worker's started batches, oldest first, shared by its two threads under the batcher's lock: ``started``
    wakes the answering thread, ``freed`` the forming thread once a batch's place in flight is given back."""

    def __init__(self, lock: threading.Lock) -> None:
        self.running: collections.deque[tuple[list[_Request], Callable[..., Any]]] = collections.deque()
        self.started = threading.Condition(lock)
        self.freed = threading.Condition(lock)
        self.forming = True  # False once the forming thread has stopped: the answering thread ends when all are out
        self.after_start: list[_Answers] = []  # asyncio answers the forming thread sends once it started the next batch
        self.answered = float("-inf")  # monotonic time the last batch's place was freed (its answers out or going)


class _NoSet:
    """What ``DynamicBatcher._start`` returns when no buffer set was free."""


_NO_SET = _NoSet()


class DynamicBatcher:
    """Packs concurrent requests into batches for ``engines``; thread-safe.

    ``max_batch``: rows per batch (default: the largest bucket). ``max_wait_ms``: how long the
    oldest request waits for company. ``timeout``: seconds a request may wait before it fails
    (default 10; per request with ``submit(..., timeout=)``; None waits forever). ``workers``:
    how many batches form and run side by side (give the engines at least as many buffer sets; on a GPU each
    worker keeps two batches in flight when the engines have two sets per worker). A worker is two threads: one
    forms and starts batches, one waits for each started batch (without the GIL) and answers it.
    ``switch_interval``: the interpreter's GIL switch interval at most, in seconds, while the batcher is open
    (``compiler.serve.switching``; None leaves it as it is).
    """

    def __init__(self, engines: _Engines, *, max_batch: int | None = None, max_wait_ms: float = defaults.MAX_WAIT_MS,
                 timeout: float | None = 10.0, workers: int = 1,
                 switch_interval: float | None = defaults.SWITCH_INTERVAL_S) -> None:
        self._policy = BatchPolicy.of(engines.buckets, max_batch, max_wait_ms, timeout)  # ``compiler.serve.batching``
        if workers < 1:
            raise InputError(f"workers={workers}: the batcher needs at least one worker")
        self.engines = engines
        self._unbatched = tuple(sorted(i.name for i in engines.spec.inputs if not i.dims or i.dims[0] != BATCH_DIM))
        self.timeout = timeout
        self._lanes: tuple[collections.deque[_Request], collections.deque[_Request]] = (
            collections.deque(), collections.deque())  # high priority, normal
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # requests queued (or closed): a forming thread with room takes
        self._queued = 0  # rows waiting in the lanes
        self._closed = False
        self._drain = True
        self._workers = workers
        self._overdue = OverdueWaits(_OVERLOADED)
        self._most_in_flight = self._depth()
        name = getattr(engines, "name", "these engines")
        if engines.queues_on_gpu and getattr(engines, "launches_on_host", False) and not getattr(
                engines, "starts_at_once", True):
            log.warning("%s launch every kernel of a batch from the batcher's thread, holding the GIL (eager torch "
                        "without CUDA graphs): this process's threads and coroutines wait behind each launch. Load "
                        "them with cuda_graphs=True, or serve through ProcessBatcher (compiler.serve.processes)", name)
        warn_of_split_batches(engines.buckets, workers, name)
        self._threaded = ThreadedCallers(self._policy.max_batch, name)  # ``submit``'s callers, until there are many
        self._inline = not engines.queues_on_gpu  # start_parts computes the batch: the forming thread answers it
        flights = [_InFlight(self._lock) for _ in range(workers)]
        # per worker, one thread forms and starts batches and one answers them (``_form``, ``_answer``)
        self._threads = [thread for i, flight in enumerate(flights) for thread in (
            threading.Thread(target=self._form, args=(flight,), name=f"trtc-batcher-{i}", daemon=True),
            threading.Thread(target=self._answer, args=(flight,), name=f"trtc-batcher-{i}-answers", daemon=True))]
        self._switching = switching.hold(switch_interval)  # given back by ``close``
        for thread in self._threads:
            thread.start()

    @property
    def max_batch(self) -> int:
        """Rows per batch at most."""
        return self._policy.max_batch

    @property
    def max_wait(self) -> float:
        """Seconds the first queued request waits for company (``max_wait_ms`` / 1000)."""
        return self._policy.max_wait

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
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._enqueue(x, timeout, priority, future, None)
        return future

    def submit(self, x: Any, *, timeout: float | None = None, priority: bool = False) -> Any:
        """Run one request through the batcher and return its outputs; blocks at most ``timeout`` seconds.

        Raises ``RequestTimeout`` when the answer does not come in time (the request is then
        dropped if it has not started), ``FeedError`` for a request that does not fit the model.
        """
        self._threaded.saw()
        waiter = _Waiter()
        self._enqueue(x, timeout, priority, waiter, None)
        limit = self.timeout if timeout is None else timeout
        if not waiter.wait(limit):
            waiter.cancelled = True
            raise RequestTimeout(f"no answer within {(limit or 0) * 1000:.0f} ms: {_OVERLOADED}")
        if waiter.error is not None:
            raise waiter.error
        return waiter.value

    async def infer(self, x: Any, *, timeout: float | None = None, priority: bool = False) -> Any:
        """``submit`` for asyncio: ``await batcher.infer(x)`` in a coroutine; the event loop is never blocked.

        Raises as ``submit`` does (the timeout fails the request up to 10 ms late: the loop looks for late
        requests every ``compiler.serve.waits.SWEEP`` seconds); a request whose caller is cancelled (or times out)
        before its batch starts is dropped.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._enqueue(x, timeout, priority, future, loop)
        limit = self.timeout if timeout is None else timeout
        if limit is None:
            return await future
        overdue = self._overdue.add(loop, future, limit, time.monotonic() + limit)
        try:
            return await future
        finally:
            overdue.drop(future)

    def _enqueue(self, x: Any, timeout: float | None, priority: bool, future: Any,
                 loop: asyncio.AbstractEventLoop | None) -> None:
        if timeout is not None and timeout <= 0:
            raise InputError(f"timeout={timeout} must be positive")
        single = not isinstance(x, Mapping)
        call = self.engines.check(x)
        feed = {self.engines.input_names[0]: x} if single else x
        limit = self.timeout if timeout is None else timeout
        now = time.monotonic()
        request = _Request(call, single, _signature(call, feed, self._unbatched),
                           now + limit if limit is not None else float("inf"), limit or 0.0, now, future, loop)
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
        with self._lock:
            given_back, self._switching = self._switching, False
        if given_back:
            switching.release()

    # -- the workers' side --

    def _depth(self) -> int:
        """Batches each worker keeps in flight: two on a GPU with a buffer set to spare for every worker (two per
        context) and a ``start_parts`` that does not launch every kernel from Python on the worker's thread
        (``starts_at_once``): the host copies one batch in while the GPU runs the other (an H200, one context, a
        CNN: 64-75 % of its bound with one). One elsewhere: eager torch launches a batch's kernels from the worker's
        thread holding the GIL (queueing a batch while thread callers waited took a CNN's rows from 7-26 % of the
        bound to 3-8 % on an H200), and on the CPU ``start_parts`` computes the batch itself."""
        overlap = self.engines.queues_on_gpu
        sets = getattr(self.engines, "buffer_sets", 1)
        return 2 if overlap and sets >= 2 * self._workers and getattr(self.engines, "starts_at_once", True) else 1

    def _form(self, flight: _InFlight) -> None:
        """A worker's first thread: take each batch once it is ready and the worker has a place for it in flight,
        start it, and hand it to the worker's answering thread (``_answer``).

        It never looks at a running batch: the answering thread waits for each one without the GIL and frees its
        place, so nothing polls. (A worker that looked for the next batch every 0.1 ms while its last one ran took
        the GIL thousands of times a second from the threads that launch, pack and answer.) Engines on the CPU
        compute a batch in ``start_parts``: it is answered here, with no hand-off.
        """
        waiting: list[_Request] | None = None  # a batch taken when no buffer set was free: started first
        try:
            while True:
                if waiting is None:
                    answers = _Answers()
                    batch = self._next_batch(answers, flight)
                    answers.send()  # requests that timed out in the queue
                    if batch is None:
                        return
                else:
                    batch, waiting = waiting, None
                if batch:
                    waiting = self._start_batch(batch, flight)
                self._send_after_start(flight)
        finally:
            with self._lock:
                flight.forming = False
                flight.started.notify()
            self._send_after_start(flight)

    def _start_batch(self, batch: list[_Request], flight: _InFlight) -> list[_Request] | None:
        """Start ``batch`` and hand it to the answering thread (or answer it here, on the CPU); the batch back when
        the answering thread holds a buffer set and no other is free (waiting for one then could deadlock with
        another batcher on the same engines, each holding one)."""
        started = self._start(batch, wait=not flight.running)  # holds no buffer set: may wait for one
        if started is _NO_SET:
            with self._lock:
                if flight.running:
                    flight.freed.wait(_SET_RETRY)
            return batch
        if not isinstance(started, tuple):
            return None  # it failed: its callers have been told why
        if self._inline and not flight.running:
            self._finish(*started).send()
            return None
        with self._lock:
            flight.running.append(started)
            flight.started.notify()
        return None

    def _send_after_start(self, flight: _InFlight) -> None:
        with self._lock:
            later, flight.after_start = flight.after_start, []
        for answers in later:
            answers.send()

    def _answer(self, flight: _InFlight) -> None:
        """A worker's second thread: wait for each started batch, oldest first (without the GIL: ``wait`` on the
        device), and answer its callers.

        When every caller is an asyncio request and the forming thread waits for this batch's place, the answers go
        out after the next batch has started (the forming thread sends them): the event loop's work on them then
        overlaps the GPU instead of holding up the next batch's copy for the GIL (on an H200, a CNN with one
        context: 9.6 k req/s at p99 15 ms against 7.0 k at 20.5 ms). Thread callers are answered before the place
        is given back: their 64 wake-ups would otherwise fight the next batch's start for the GIL (ONNX Runtime:
        1.0 k req/s against 2.7 k)."""
        while True:
            with self._lock:
                while not flight.running and flight.forming:
                    flight.started.wait()
                if not flight.running:
                    return
                batch, finish = flight.running[0]
            try:
                answers = self._finish(batch, finish)
            except BaseException:  # answered with the error already; the place is given back all the same
                self._free(flight)
                raise
            if all(r.loop is not None for r in batch):
                with self._lock:
                    later = flight.forming and len(flight.running) >= self._most_in_flight
                    if later:
                        flight.after_start.append(answers)
                    self._freed(flight)
                if not later:
                    answers.send()
                continue
            try:
                answers.send()
            finally:
                self._free(flight)

    def _free(self, flight: _InFlight) -> None:
        """Give the oldest started batch's place back (its answers are out, or go out after the next start)."""
        with self._lock:
            self._freed(flight)

    def _freed(self, flight: _InFlight) -> None:
        """With the lock held: the oldest started batch is done. Wakes this worker's forming thread, waiting for a
        place (``freed``) or for the batch to end before it takes a padded one (``_cond``: the batching policy)."""
        flight.running.popleft()
        flight.answered = time.monotonic()
        flight.freed.notify()
        self._cond.notify_all()

    def _next_batch(self, answers: _Answers, flight: _InFlight) -> list[_Request] | None:
        """Wait until the queue makes a batch (``BatchPolicy.ready``) and ``flight`` has a place for it, and take it;
        None when closed and empty (or closed without draining)."""
        high, normal = self._lanes
        with self._lock:
            while True:
                if self._closed and not self._drain:
                    closed = "the batcher was closed before this request ran"
                    for queue in self._lanes:
                        while queue:
                            answers.fail(queue.popleft(), BatcherClosed(closed))
                    self._queued = 0
                    return None
                if len(flight.running) >= self._most_in_flight:
                    flight.freed.wait()  # a full worker leaves the queue's wake-ups to the others
                    continue
                if not (high or normal):
                    if self._closed:
                        return None
                    if flight.after_start:
                        return []  # no batch to start now: the forming thread sends those answers first
                    self._cond.wait()
                    continue
                # the queue's first request is looked up again after every wait: another worker may have taken the
                # one this worker waited for (a window then seemed over for a queue that had emptied)
                first = (high[0] if high else normal[0]).submitted
                now = time.monotonic()
                running = bool(flight.running)
                if self._closed or self._policy.ready(self._queued, first, now, running=running,
                                                      answered=flight.answered):
                    return self._take(answers)
                if flight.after_start:
                    return []
                padded = self._policy.padded(self._queued)
                if padded and running:
                    self._cond.wait()  # until the running batch's place is freed, or the queue fills a batch
                else:
                    self._cond.wait(self._policy.window_end(first, flight.answered, padded) - now)

    def _take(self, answers: _Answers) -> list[_Request]:
        """Pop the requests of one batch (``BatchPolicy.take``; the high lane first), failing the expired ones; with
        ``_lock`` held. What is left is another worker's next batch: one is woken for it.

        The policy looks at the queue's first ``max_batch`` requests, and at the whole queue only when the batch
        it takes from those is not full: first fit stops once the batch is full, so a full batch of the first
        requests is the whole queue's (and converting a queue of objects to the policy's arrays costs Python per
        request). Requests past those expire at a later look."""
        now = time.monotonic()
        high, normal = self._lanes
        size = len(high) + len(normal)
        look = min(size, self.max_batch)
        while True:
            queue = list(itertools.islice(itertools.chain(high, normal), look))
            rows = np.array([r.call.rows for r in queue], np.int64)
            taken = self._policy.take(rows, _signature_codes([r.signature for r in queue]),
                                      np.array([r.deadline for r in queue], np.float64), now)
            if look == size or taken.rows >= self.max_batch:
                break
            look = size
        for index in taken.expired.tolist():
            request = queue[index]
            answers.fail(request, RequestTimeout(
                f"the request waited {(now - request.submitted) * 1000:.0f} ms in the queue, over its timeout "
                f"of {request.timeout * 1000:.0f} ms: {_OVERLOADED}"))
        # a request whose caller gave up (cancelled, or timed out) is dropped here, and its rows are left empty
        batch = [queue[index] for index in taken.batch.tolist() if queue[index].start()]
        # the requests looked at leave the lanes, and those kept go back in front, in their order
        from_high = min(look, len(high))
        for _ in range(from_high):
            high.popleft()
        for _ in range(look - from_high):
            normal.popleft()
        kept = np.flatnonzero(taken.left).tolist()
        split = bisect.bisect_left(kept, from_high)  # kept[:split] came from the high lane
        high.extendleft(queue[index] for index in reversed(kept[:split]))
        normal.extendleft(queue[index] for index in reversed(kept[split:]))
        self._queued -= taken.rows + (int(rows[taken.expired].sum()) if len(taken.expired) else 0)
        if self._queued:
            self._cond.notify()
        return batch

    def _start(self, batch: list[_Request], wait: bool = True,
               ) -> tuple[list[_Request], Callable[[], dict[str, Any]]] | _NoSet | None:
        """Queue the batch on the engines; None when that failed (its callers have been told why), ``_NO_SET``
        when ``wait`` is False and no buffer set was free."""
        calls = [r.call for r in batch]
        try:
            started = self.engines.start_parts(calls) if wait else self.engines.start_parts(calls, wait=False)
            return _NO_SET if started is None else (batch, started)
        except BaseException as err:  # every caller of the batch learns why; the worker keeps serving
            answers = _Answers()
            for request in batch:
                answers.set(request, error=err)
            answers.send()
            if not isinstance(err, Exception):
                raise
            return None

    def _finish(self, batch: list[_Request], finish: Callable[[], dict[str, Any]]) -> _Answers:
        """Wait for a started batch and slice every caller's answer (or the error) into ``_Answers``, unsent."""
        answers = _Answers()
        try:
            outputs = finish()
        except BaseException as err:
            for request in batch:
                answers.set(request, error=err)
            if not isinstance(err, Exception):
                answers.send()
                raise
            return answers
        names = self.engines.output_names
        offset = 0
        for request in batch:
            part = {name: outputs[name][offset:offset + request.rows] for name in names}
            offset += request.rows
            if request.call.kind != "numpy" and isinstance(outputs[names[0]], np.ndarray):
                part = as_kind(part, request.call)
            answers.set(request, part[names[0]] if request.single and len(names) == 1 else part)
        return answers


def _signature_codes(signatures: list[tuple[Any, ...]]) -> np.ndarray:
    """The signatures of a queue as ``BatchPolicy.take`` takes them: a number per request, equal for equal
    signatures; no column when all are equal (the common case, found by one C-level count)."""
    if signatures.count(signatures[0]) == len(signatures):
        return np.empty((len(signatures), 0), np.int64)
    codes: dict[tuple[Any, ...], int] = {}
    return np.array([codes.setdefault(s, len(codes)) for s in signatures], np.int64).reshape(-1, 1)


def _signature(call: CheckedFeed, feed: Mapping[str, Any], unbatched: tuple[str, ...]) -> tuple[Any, ...]:
    """What must agree for two requests to share a batch: the sizes of the dynamic dimensions, the device of
    inputs on a GPU, and the very same array for every input without a batch dimension (shared by the whole
    batch). dtypes and fixed sizes need no comparing: ``check`` held every request to the model's."""
    return (call.key, call.device if call.on_device else None, *(id(feed[name]) for name in unbatched))
