"""A dynamic batcher for requests from other processes, through shared memory: ``ProcessBatcher``.

One Python process answers 11-14 k requests a second from 64 threads and 35-60 k from asyncio
coroutines on an H200 host (its GIL; docs/benchmarks.md), while one GPU runs a small transformer at
60-101 k rows a second. A server with several worker processes (one per core, as web servers run)
sends their requests to the one process that owns the GPU:

    # the process that owns the GPU
    batcher = ProcessBatcher(compiler.load("build/m"), max_wait_ms=5)
    handles = [batcher.client_handle(slots=8) for _ in range(16)]
    spawn = multiprocessing.get_context("spawn")
    workers = [spawn.Process(target=serve, args=(handle,)) for handle in handles]

    # in each worker process (it imports numpy and this module, never torch or ONNX Runtime)
    def serve(handle):
        client = handle.connect()
        y = client.submit(x, timeout=0.5)       # from up to `slots` threads at once

How a request travels: every request has a slot in one shared-memory file (room for ``slot_rows``
rows of every input at the model's largest sizes, for the outputs, and a few numbers). The client
checks its arrays, copies them into its slot and writes the slot's number (4 bytes) into a pipe.
The batcher reads many numbers per read, copies the slots' rows into the pinned input buffers of a
context (``Engines.start_parts``; a small batch of single rows is first gathered with one numpy call
per input, a large one is copied straight from the slots), runs the bucket, and wakes each client process with
one write of its slots' numbers into the process's own pipe (a thread there wakes the callers). On
a GPU the batch's outputs are copied by the GPU into a page-locked results area of the shared
memory, and each client copies its rows from there (an area serves the next batches once all its
answers are read, or their time is over); on the CPU the batcher writes all answers of the batch
into their slots with one numpy assignment per output. So the batcher spends a few microseconds of
Python per request, and the clients' own work runs in their processes under their own GILs. (A
semaphore per slot cost the batcher a wake-up system call per request: 5-20 microseconds of its GIL
each, the largest part of its time.)

Why not ``multiprocessing.Queue``: it pickles every array and wakes a feeder thread per message,
tens of microseconds per request on the GPU process's one GIL.

Handles are passed to processes started by ``multiprocessing`` (``spawn`` or ``fork``) after the
batcher exists, one handle per process. The shared memory is a file in ``/dev/shm`` removed as soon
as it is made (the handles carry its descriptor), so nothing is left behind, even after a crash.
When the batcher closes or its process ends, spawned clients' waiting callers fail at once with
``BatcherClosed`` (forked clients hold the pipes' other ends too, so they only see their timeouts).
Inputs must all have the batch dimension first and a numpy dtype (no bfloat16); models whose output
sizes depend on the data can outgrow their slots (such a batch fails with a message).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import itertools
import logging
import math
import mmap
import multiprocessing
import os
import queue
import select
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.backends.feeds import NUMPY_DTYPES, InputCheck, check_shape, checks_for, mismatch
from compiler.core.errors import FeedError, InputError
from compiler.core.specs import BATCH_DIM, DimRange, ModelSpec
from compiler.serve.batcher import check_settings, is_ready
from compiler.serve.waits import BatcherClosed, OverdueWaits, RequestTimeout

__all__ = ["ProcessBatcher", "ClientHandle", "BatcherClient", "RequestFailed"]

log = logging.getLogger(__name__)

_OK, _FAILED, _EXPIRED, _CLOSED = 1, 2, 3, 4  # a slot's status after its answer
_ERROR_BYTES = 480  # room for the message of a failed request
_ALIGN = 64
_PAGE = mmap.PAGESIZE  # the results areas start on a page: the GPU copies into them (cudaHostRegister)
_UNREAD_HOLD = 10.0  # seconds an area waits for unread answers of requests without a timeout
# Whether a GPU's outputs go into results areas (False: the batcher writes every answer into its slot);
# ``benchmarks/serving_gpu.py --no-results-areas`` compares.
RESULTS_AREAS = True
_NAP = 0.0001  # seconds the thread sleeps after each read of the pipe, and between looks for a batch to start
_FEEDS_PER_SLOT = 8  # (rows, sizes) whose feed a slot keeps
# a batch of single-row requests whose inputs are at most this large is gathered from the slots in one numpy call per
# input (``np.take``) instead of one feed per request: a second copy of a small batch costs less than the per-request
# Python (about 1.5 us a request, the batcher's thread being the limit for a small transformer on an H200)
_GATHER_BYTES = 1 << 20
_GONE = "the batcher is closed, or its process ended; restart the server"
_GRACE = 1.0  # seconds a caller waits past its timeout for a batch that started just before it
_OVERLOADED = "the server is overloaded; raise the timeout, or add contexts (in_flight) or GPUs"


class RequestFailed(RuntimeError):
    """The request's batch failed in the serving process (its message says why)."""


# --- the shared memory ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Field:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class _Layout:
    """Where every array of the shared-memory file lies: plain numbers, so it pickles with a handle."""

    fields: tuple[_Field, ...]
    size: int

    @staticmethod
    def of(arrays: Sequence[tuple[str, str, tuple[int, ...]] | tuple[str, str, tuple[int, ...], int]]) -> _Layout:
        """Fields one after the other, each at a multiple of ``_ALIGN`` bytes (or of its own alignment, a fourth
        element: a page for memory the GPU writes into)."""
        fields = []
        offset = 0
        for name, dtype, shape, *align in arrays:
            step = align[0] if align else _ALIGN
            offset = -(-offset // step) * step
            fields.append(_Field(name, dtype, shape, offset))
            offset += -(-fields[-1].nbytes // _ALIGN) * _ALIGN
        return _Layout(tuple(fields), max(offset, _ALIGN))

    def views(self, buffer: Any) -> dict[str, np.ndarray]:
        return {f.name: np.frombuffer(buffer, dtype=f.dtype, count=math.prod(f.shape), offset=f.offset)
                .reshape(f.shape) for f in self.fields}


@dataclass(frozen=True)
class _Io:
    """One input or output as the slots hold it: dims as the spec writes them (names for dynamic sizes)."""

    name: str
    dtype: str
    dims: tuple[int | str, ...]  # without the batch dimension
    largest: tuple[int, ...]  # the slot's room: the dims at their largest


@dataclass(frozen=True)
class _Model:
    inputs: tuple[_Io, ...]
    outputs: tuple[_Io, ...]
    dim_names: tuple[str, ...]  # the dynamic non-batch dims, in the order a slot stores their values
    ranges: dict[str, DimRange]  # of each
    checks: tuple[InputCheck, ...]  # the inputs' contracts, as ``Engines`` checks them
    slot_rows: int


def _regions(model: _Model, slots: int, results: int, max_batch: int) -> list[Any]:
    """The shared memory's fields: per slot its request and answer; ``results`` areas of ``max_batch`` rows of every
    output, where the GPU copies a batch's outputs and the clients read them (``where``: area, first row and the
    area's generation per answered slot; ``taken``: the answer number a client has read)."""
    regions: list[Any] = [(f"in:{io.name}", io.dtype, (slots, model.slot_rows, *io.largest)) for io in model.inputs]
    regions += [(f"out:{io.name}", io.dtype, (slots, model.slot_rows, *io.largest)) for io in model.outputs]
    ranks = max([len(io.largest) for io in model.outputs] + [1])
    regions += [("rows", "int64", (slots,)), ("dims", "int64", (slots, max(1, len(model.dim_names)))),
                ("asked", "int64", (slots,)), ("answered", "int64", (slots,)), ("status", "int64", (slots,)),
                ("out_shapes", "int64", (slots, len(model.outputs), ranks)),
                ("submitted", "float64", (slots,)), ("deadline", "float64", (slots,)),
                ("error", "uint8", (slots, _ERROR_BYTES)), ("closed", "int64", (1,)),
                ("where", "int64", (slots, 3)), ("taken", "int64", (slots,)),
                ("generation", "int64", (max(1, results),))]
    if results:
        regions += [(f"res:{io.name}", io.dtype, (results, max_batch * math.prod(io.largest)), _PAGE)
                    for io in model.outputs]
    return regions


def _region(area: np.ndarray, slot: int | slice, rows: int, shape: Sequence[int]) -> tuple[Any, ...]:
    """The index of one request's rows at ``shape`` (its non-batch sizes) in a slot area."""
    return (slot, slice(0, rows), *(slice(0, n) for n in shape))


# --- the client's side -----------------------------------------------------------------------------------------------

@dataclass
class ClientHandle:
    """What a client process needs to reach a ``ProcessBatcher``: pass it to a process started by ``multiprocessing``
    (as an argument), then call ``connect()`` there. Its slots are its own: one handle per process."""

    memory: Any  # the shared memory's descriptor (a multiprocessing Connection: it travels to spawned processes)
    layout: _Layout
    model: _Model
    slots: tuple[int, ...]
    answers: Any  # the read end of this handle's pipe: the numbers of its answered slots
    writer: Any  # the write end of the batcher's pipe (a multiprocessing Connection)
    timeout: float | None

    def connect(self) -> BatcherClient:
        """Attach to the batcher's shared memory (in the client process; once per handle and process)."""
        with _CONNECTED_LOCK:
            if self.answers in _CONNECTED:
                raise InputError("this handle is connected already in this process: use that client (it is "
                                 "thread-safe), or give each process its own client_handle()")
            _CONNECTED.add(self.answers)
        return BatcherClient(self)


_CONNECTED: weakref.WeakSet[Any] = weakref.WeakSet()  # answer pipes read by a client of this process
_CONNECTED_LOCK = threading.Lock()


class BatcherClient:
    """Sends requests to a ``ProcessBatcher`` from another process; thread-safe (one request per slot at a time).

    ``submit(x)`` takes what ``engines(x)`` takes (numpy arrays or CPU tensors, batch first, at most
    ``slot_rows`` rows) and returns what it returns (one array for a one-input, one-output model given
    one array, else a dict by output name, as numpy arrays). ``await client.infer(x)`` is the same for
    coroutines of an asyncio server (the answers of one batch reach their event loop in one call).
    """

    def __init__(self, handle: ClientHandle) -> None:
        try:
            self._map = mmap.mmap(handle.memory.fileno(), handle.layout.size)
        except (OSError, ValueError):
            raise BatcherClosed("the batcher's shared memory is gone: the batcher was closed") from None
        self._handle = handle
        self._model = handle.model
        self._arrays = handle.layout.views(self._map)
        self._inputs = [(io, self._arrays[f"in:{io.name}"]) for io in self._model.inputs]  # the slots' input areas
        self._outputs = [(io, self._arrays[f"out:{io.name}"]) for io in self._model.outputs]
        self._results = [self._arrays.get(f"res:{io.name}") for io in self._model.outputs]  # see ``_regions``
        self._fd = handle.writer.fileno()
        self._ready = {slot: threading.Lock() for slot in handle.slots}  # released when the slot's answer is in
        for lock in self._ready.values():
            lock.acquire()
        asked, answered = self._arrays["asked"], self._arrays["answered"]
        self._number = {slot: int(asked[slot]) for slot in handle.slots}
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._abandoned: set[int] = set()  # slots of requests whose caller gave up; free again once answered
        for slot in handle.slots:
            if asked[slot] == answered[slot]:
                self._free.put(slot)
            else:  # a request of an earlier process with this handle is still unanswered
                self._abandoned.add(slot)
        self._futures: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}  # ``infer``'s waits
        self._overdue = OverdueWaits(_OVERLOADED)
        self._lock = threading.Lock()
        self._answers = handle.answers.fileno()
        self._gone = False  # the batcher's process ended (its end of the answers' pipe closed)
        threading.Thread(target=self._wake_callers, name="trtc-batcher-client", daemon=True).start()

    @property
    def input_names(self) -> list[str]:
        return [io.name for io in self._model.inputs]

    @property
    def output_names(self) -> list[str]:
        return [io.name for io in self._model.outputs]

    def submit(self, x: Any, *, timeout: float | None = None) -> Any:
        """Run one request through the batcher and return its outputs. Raises ``FeedError`` at once for a request
        that does not fit the model, ``RequestTimeout``, ``BatcherClosed``, or ``RequestFailed`` when its batch
        failed. ``timeout`` (default: the batcher's) counts from the call; the batcher answers every request by
        then (an expired one without running it) or with its batch, and the caller waits ``_GRACE`` seconds more
        for a batch that started just before the deadline."""
        limit, single, arrays, rows, dims = self._request(x, timeout)
        end = time.monotonic() + (limit if limit is not None else math.inf)
        slot = self._take_slot(end)
        try:
            number = self._send(slot, arrays, rows, dims, end)
        except BaseException:
            self._free.put(slot)
            raise
        ready = self._ready[slot]
        while True:  # a wake-up is a hint; the slot's answered number says whose answer is in
            left = end + _GRACE - time.monotonic()
            if not ready.acquire(timeout=-1 if limit is None else max(0.0, left)):
                with self._lock:
                    self._abandoned.add(slot)
                raise RequestTimeout(f"no answer within {(limit or 0) * 1000:.0f} ms: {_OVERLOADED}")
            if self._gone or int(self._arrays["answered"][slot]) == number:
                return self._finish(slot, number, rows, single)

    async def infer(self, x: Any, *, timeout: float | None = None) -> Any:
        """``submit`` for asyncio: ``await client.infer(x)`` in a coroutine; the event loop is never blocked (when
        every slot is busy, it waits for one in steps of a millisecond). A wait past its time (a stalled batcher:
        it answers every request by its deadline) is failed by a look of its event loop every 10 ms, as
        ``DynamicBatcher.infer``'s are (``OverdueWaits``)."""
        limit, single, arrays, rows, dims = self._request(x, timeout)
        loop = asyncio.get_running_loop()
        end = time.monotonic() + (limit if limit is not None else math.inf)
        while (slot := self._free_slot()) is None:
            self._check_open()
            if time.monotonic() >= end:
                raise RequestTimeout(self._busy())
            await asyncio.sleep(0.001)
        number = -1
        while True:  # a wake-up is a hint; the slot's answered number says whose answer is in
            future: asyncio.Future[None] = loop.create_future()
            with self._lock:  # before the request is sent: its answer may come at once
                if self._gone:  # the wake thread has ended: nobody would settle the future
                    raise BatcherClosed(_GONE)
                self._futures[slot] = (loop, future)
            overdue = None if limit is None else self._overdue.add(loop, future, limit, end + _GRACE)
            try:
                if number < 0:
                    number = self._send(slot, arrays, rows, dims, end)
                await future
            except BaseException:  # a timeout or the caller's cancellation: the slot is free once answered
                with self._lock:
                    self._futures.pop(slot, None)
                    if number < 0 or int(self._arrays["answered"][slot]) == number:  # never sent, or answered
                        if number >= 0:
                            self._arrays["taken"][slot] = number  # never read: its results area may serve again
                        self._free.put(slot)
                    else:
                        self._abandoned.add(slot)  # its answer will release the slot's lock, as for ``submit``
                raise
            finally:
                if overdue is not None:
                    overdue.drop(future)
            if self._gone or int(self._arrays["answered"][slot]) == number:
                return self._finish(slot, number, rows, single)

    def _request(self, x: Any, timeout: float | None) -> tuple[float | None, bool, list[np.ndarray], int, list[int]]:
        """A request checked and the batcher reachable: (timeout, single, arrays, rows, dynamic sizes)."""
        limit = self._handle.timeout if timeout is None else timeout
        if limit is not None and limit <= 0:
            raise InputError(f"timeout={limit} must be positive")
        single = not isinstance(x, Mapping)
        feed = {self._model.inputs[0].name: x} if single else x
        arrays, rows, dims = self._checked(feed, single)
        self._check_open()
        return limit, single, arrays, rows, dims

    def _check_open(self) -> None:
        if not self._arrays:
            raise BatcherClosed("this client is closed")
        if self._gone or self._arrays["closed"][0]:
            raise BatcherClosed(_GONE)

    def _send(self, slot: int, arrays: list[np.ndarray], rows: int, dims: list[int], end: float) -> int:
        """Copy the request into its slot and announce it; its number (what the answer must carry)."""
        slots = self._arrays
        number = self._number[slot] + 1
        for (io, area), array in zip(self._inputs, arrays, strict=True):
            if array.shape[1:] == io.largest:  # the common case, quicker than a region's slices
                area[slot, :rows] = array
            else:
                area[_region(area, slot, rows, array.shape[1:])] = array
        slots["rows"][slot] = rows
        if dims:
            slots["dims"][slot, :len(dims)] = dims
        slots["submitted"][slot] = time.monotonic()
        slots["deadline"][slot] = end
        slots["asked"][slot] = number
        self._number[slot] = number
        try:
            os.write(self._fd, slot.to_bytes(4, "little"))
        except OSError:
            raise BatcherClosed(_GONE) from None
        return number

    def _finish(self, slot: int, number: int, rows: int, single: bool) -> Any:
        """The answer of an answered slot, which is free again after."""
        if self._gone and int(self._arrays["answered"][slot]) != number:
            raise BatcherClosed(_GONE)  # the slot stays taken: nobody will answer it
        try:
            return self._answer(slot, number, rows, single)
        finally:
            self._free.put(slot)

    def _checked(self, feed: Mapping[str, Any], single: bool) -> tuple[list[np.ndarray], int, list[int]]:
        """The request's arrays held to the model's contract (``compiler.serve.feeds``, as ``Engines`` holds them),
        its rows and its dynamic sizes in slot order."""
        model = self._model
        if single and len(model.inputs) != 1:
            raise FeedError(f"the model takes inputs {self.input_names}: pass a dict {{name: array}}")
        if len(feed) != len(model.inputs) or any(io.name not in feed for io in model.inputs):
            raise mismatch(self.input_names, feed)
        arrays = []
        rows = -1
        sizes: dict[str, int] = {}
        for check in model.checks:
            value = feed[check.name]
            array = value if type(value) is np.ndarray else _as_array(value, check.name)
            if array.dtype != check.np_dtype:
                raise FeedError(f"input {check.name!r} has dtype {array.dtype}, the model takes {check.dtype}: pass "
                                f"x.astype(np.{check.dtype})")
            rows = check_shape(check, array.shape, rows, sizes, model.ranges)
            arrays.append(array)
        dims = [sizes[name] for name in model.dim_names]
        if rows == 0:
            raise FeedError("the batch is empty (0 rows): pass at least one row")
        if rows > model.slot_rows:
            raise FeedError(f"the request has {rows} rows and a slot holds {model.slot_rows}: split it, or make the "
                            f"batcher with slot_rows={rows}")
        return arrays, rows, dims

    def _take_slot(self, end: float) -> int:
        while (slot := self._free_slot()) is None:
            self._check_open()
            wait = min(0.01, end - time.monotonic())
            if wait <= 0:
                raise RequestTimeout(self._busy())
            with contextlib.suppress(queue.Empty):
                return self._free.get(timeout=wait)
        return slot

    def _free_slot(self) -> int | None:
        """A free slot, or one whose caller gave up and whose answer has come since; None when all are busy."""
        with contextlib.suppress(queue.Empty):
            return self._free.get_nowait()
        with self._lock:
            slots = self._arrays
            for slot in list(self._abandoned):
                # woken and answered; woken by a second wake of an earlier answer only, the lock is held again until
                # this request's answer releases it
                if self._ready[slot].acquire(False) and slots["asked"][slot] == slots["answered"][slot]:
                    self._abandoned.discard(slot)
                    slots["taken"][slot] = slots["answered"][slot]  # never read: its results area may serve again
                    return slot
        return None

    def _busy(self) -> str:
        return (f"all {len(self._ready)} slots of this client are busy: connect with more slots "
                "(client_handle(slots=...)), or send fewer requests at once")

    def _wake_callers(self) -> None:
        """The client's thread that reads the numbers of answered slots from its pipe and wakes their callers."""
        ready = self._ready
        while True:
            try:
                data = os.read(self._answers, 1 << 12)
            except OSError:
                data = b""
            gone = not data  # the batcher's process ended: nobody answers the callers still waiting
            by_loop: _ByLoop = {}
            with self._lock:  # ``infer`` registers its wait under it: none is added after this last pass
                if gone:
                    self._gone = True
                    slots = [slot for slot, lock in ready.items() if lock.locked() or slot in self._futures]
                else:
                    slots = np.frombuffer(data, dtype="<i4").tolist()
                for slot in slots:
                    waiting = self._futures.pop(slot, None)
                    if waiting is None:
                        lock = ready.get(slot)
                        if lock is not None and lock.locked():  # a second wake for one answer is harmless
                            lock.release()
                    else:
                        by_loop.setdefault(waiting[0], []).append(waiting[1])
            _settle_on_loops(by_loop)
            if gone:
                return

    def _answer(self, slot: int, number: int, rows: int, single: bool) -> Any:
        arrays = self._arrays
        if int(arrays["answered"][slot]) != number:
            raise RequestFailed(f"slot {slot} holds the answer to request {int(arrays['answered'][slot])}, not "
                                f"{number}: two clients share a handle; give each process its own client_handle()")
        status = int(arrays["status"][slot])
        if status != _OK:
            text = bytes(arrays["error"][slot]).rstrip(b"\0").decode("utf-8", "replace")
            if status == _EXPIRED:
                raise RequestTimeout(text)
            if status == _CLOSED:
                raise BatcherClosed(text)
            raise RequestFailed(text)
        shapes = arrays["out_shapes"][slot]
        results, first, generation = arrays["where"][slot].tolist()
        outputs = {}
        for j, (io, area) in enumerate(self._outputs):
            shape = tuple(shapes[j, :len(io.largest)].tolist())
            if results < 0:  # the batcher wrote the answer into the slot
                outputs[io.name] = np.array(area[_region(area, slot, rows, shape)])
                continue
            size = math.prod(shape)
            flat = self._results[j][results]  # type: ignore[index]
            outputs[io.name] = flat[first * size:(first + rows) * size].reshape(rows, *shape).copy()
        if results >= 0:
            arrays["taken"][slot] = number  # the batcher may copy the next batch into the area once all are read
            # (an area is given to another batch before all are read only after their time is over; the check
            # below relies on x86's ordering of the copy's loads before this one)
            if int(arrays["generation"][results]) != generation:
                raise RequestFailed("the answer was overwritten before this client read it: its process stalled "
                                    "for over its timeout after the answer came; raise the timeout")
        if single and len(outputs) == 1:
            return next(iter(outputs.values()))
        return outputs

    def close(self) -> None:
        """Detach from the shared memory (the batcher keeps running); later calls raise ``BatcherClosed``."""
        if self._arrays:
            slots = list(self._ready)
            self._arrays["taken"][slots] = self._arrays["answered"][slots]  # none of them is read any more
        self._arrays = {}
        self._results = []
        self._inputs, self._outputs = [], []
        with contextlib.suppress(BufferError):  # a view still held by a caller keeps the mapping alive
            self._map.close()

    def __enter__(self) -> BatcherClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_ByLoop = dict[asyncio.AbstractEventLoop, list[asyncio.Future[None]]]  # futures to settle, by their event loop


def _settle_on_loops(by_loop: _ByLoop) -> None:
    """From the client's thread: settle each loop's futures on that loop (``_settle``), one call per loop."""
    for loop, futures in by_loop.items():
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for these
            loop.call_soon_threadsafe(_settle, futures)


def _settle(futures: list[asyncio.Future[None]]) -> None:
    """On the event loop: wake the coroutines whose answers are in (unless they stopped waiting)."""
    for future in futures:
        if not future.done():
            future.set_result(None)


def _as_array(value: Any, name: str) -> np.ndarray:
    try:
        return np.asarray(value)
    except (TypeError, RuntimeError, ValueError):
        raise FeedError(f"input {name!r} is a {type(value).__name__} that is not host memory; pass a numpy array "
                        "or a CPU tensor") from None


@dataclass(frozen=True)
class _Requests:
    """Requests as the batcher's thread holds them, oldest first: an array per field, so that reading, taking a batch
    and answering it cost a few numpy calls per batch, not Python per request."""

    slots: np.ndarray  # int64
    rows: np.ndarray  # int64
    dims: np.ndarray  # int64, (requests, dynamic non-batch dims): the sizes a batch's requests share
    deadlines: np.ndarray  # float64, monotonic seconds
    submitted: np.ndarray  # float64, monotonic seconds

    def __len__(self) -> int:
        return len(self.slots)

    @functools.cached_property
    def total_rows(self) -> int:
        return int(self.rows.sum())

    def pick(self, index: Any) -> _Requests:
        return _Requests(self.slots[index], self.rows[index], self.dims[index], self.deadlines[index],
                         self.submitted[index])

    def then(self, later: _Requests) -> _Requests:
        if not len(self):
            return later
        return _Requests(*(np.concatenate([a, b]) for a, b in zip(self.fields(), later.fields(), strict=True)))

    def fields(self) -> tuple[np.ndarray, ...]:
        return self.slots, self.rows, self.dims, self.deadlines, self.submitted

    @staticmethod
    def none(dims: int) -> _Requests:
        return _Requests(np.empty(0, np.int64), np.empty(0, np.int64), np.empty((0, dims), np.int64),
                         np.empty(0, np.float64), np.empty(0, np.float64))


_Running = tuple[_Requests, Callable[..., Any], int | None]  # a started batch, its finish, its results area
_FILLING = "filling"  # a results area a started batch copies its outputs into


# --- the batcher's side ----------------------------------------------------------------------------------------------

class ProcessBatcher:
    """Packs requests from other processes into batches for ``engines``; see the module docstring.

    ``capacity``: slots in all (each holds one request in flight); ``slot_rows``: rows a request may
    have. ``max_batch``, ``max_wait_ms`` and ``timeout`` as for ``DynamicBatcher``. ``in_flight``:
    batches queued on the engines at once, at most their ``buffer_sets``; default 2 on a GPU (the next
    batch is copied in while one runs), 1 on the CPU. One thread does all
    of the batcher's work: it reads the requests, starts batches and answers them, so no second
    thread of the batcher waits for the GIL behind it (two workers and a reader thread spent
    up to half of each batch's time handing the GIL around, on an H200); ONNX Runtime without CUDA
    graphs launches each batch's kernels on a thread of its context (ONNX Runtime releases the GIL
    while it launches them).
    The shared memory is ``capacity x slot_rows`` rows of every input and output at their largest
    sizes, and on a GPU ``in_flight + 2`` results areas of ``max_batch`` rows of every output; it is
    reserved at once, so a too-small ``/dev/shm`` fails here (not with a crash later).
    """

    def __init__(self, engines: Any, *, capacity: int = 256, slot_rows: int = 1, max_batch: int | None = None,
                 max_wait_ms: float = 10.0, timeout: float | None = 10.0, in_flight: int | None = None,
                 shm_dir: str | None = None) -> None:
        if capacity < 1 or slot_rows < 1:
            raise InputError(f"capacity={capacity}, slot_rows={slot_rows}: both must be at least 1")
        check_settings(max_batch, max_wait_ms, timeout)
        sets = getattr(engines, "buffer_sets", None)
        if in_flight is None:  # on the CPU a batch runs in start_parts: a second one would only delay the answers
            in_flight = 2 if getattr(engines, "queues_on_gpu", False) and (sets or 1) >= 2 else 1
        if in_flight < 1:
            raise InputError(f"in_flight={in_flight}: the batcher runs at least one batch at a time")
        if sets is not None and in_flight > sets:  # its one thread would wait for a buffer set it holds itself
            raise InputError(f"in_flight={in_flight} but the engines have {sets} buffer set(s) "
                             f"({engines.contexts} context(s)): load them with more contexts, or lower in_flight")
        self.engines = engines
        self.in_flight = in_flight
        self.max_batch = max_batch or max(engines.buckets)
        self.max_wait = max_wait_ms / 1000.0
        self.timeout = timeout
        self._model = _model_of(engines, slot_rows)
        # on a GPU the outputs are copied into results areas of the shared memory: one per batch in flight, and two
        # whose clients are still reading (engines that take ``start_parts(out=...)``)
        areas = in_flight + 2 if RESULTS_AREAS and getattr(engines, "queues_on_gpu", False) and _takes_out(
            engines) else 0
        self._layout = _Layout.of(_regions(self._model, capacity, areas, self.max_batch))
        self._memory, self._map = _shared_memory(self._layout.size, shm_dir)
        self._arrays = self._layout.views(self._map)
        self._in = [(io, self._arrays[f"in:{io.name}"]) for io in self._model.inputs]
        self._out = [(io, self._arrays[f"out:{io.name}"]) for io in self._model.outputs]
        # per results area: {output: its flat area}, and who reads it: None (free), _FILLING (a batch copies into it)
        # or (slots, their answer numbers, when the area is free even if some never read it)
        self._results: list[dict[str, np.ndarray]] = []
        self._readers: list[Any] = []
        self._locked: int | None = None  # the address of the page-locked range of the areas
        self._device: Any = None  # the GPU whose context registered it
        self._arrays["where"][:, 0] = -1  # no answer in an area yet
        self.batches_in_areas = 0  # batches answered from a results area, and through the slots
        self.batches_in_slots = 0
        if areas:
            fields = {io.name: self._arrays[f"res:{io.name}"] for io in self._model.outputs}
            self._device = getattr(engines, "device", None)  # the GPU whose context registers the areas
            self._locked = _page_lock(list(fields.values()), self._device)
            if self._locked is not None:
                self._results = [{name: field[a] for name, field in fields.items()} for a in range(areas)]
                self._readers = [None] * areas
        spawn = multiprocessing.get_context("spawn")
        self._reader, self._writer = spawn.Pipe(duplex=False)
        self._owners = np.full(capacity, -1, np.int64)  # the handle each slot belongs to
        self._wakers: list[Any] = []  # per handle, the write end of its pipe of answered slots
        self._fd = self._reader.fileno()
        os.set_blocking(self._fd, False)
        self._poll = select.poll()  # not select.select: it refuses descriptors above 1023, common in a busy server
        self._poll.register(self._fd, select.POLLIN)
        self._capacity = capacity
        self._handed = 0  # slots given to handles so far
        self._feeds: list[dict[tuple[int, tuple[int, ...]], Any]] = [{} for _ in range(capacity)]
        # requests read from the pipe and not yet in a batch, oldest first
        self._pending = _Requests.none(len(self._model.dim_names))
        self._waiting: _Requests | None = None  # a batch taken when no buffer set was free: started next
        self._closed = False
        self._drain = True
        self._cpu_at_end = 0.0  # the thread's CPU time when it stopped (``cpu_seconds``)
        self._thread = threading.Thread(target=self._serve, name="trtc-process-batcher", daemon=True)
        self._thread.start()

    @property
    def cpu_seconds(self) -> float:
        """CPU time the batcher's thread has used so far (its total once it has stopped). The batcher's Python work
        is all on that thread, so on a GPU its growth over a span of wall time is how busy the batcher is: near
        1.0, the batcher itself is the limit (serve from more GPU processes, or send larger requests). Helper
        threads that pack large batches are not counted; engines on the CPU compute on this thread."""
        ident = self._thread.ident
        if ident is not None and self._thread.is_alive() and hasattr(time, "pthread_getcpuclockid"):
            with contextlib.suppress(OSError):  # it ended just now
                seconds = time.clock_gettime(time.pthread_getcpuclockid(ident))
                if self._thread.is_alive():  # still ours: an ident is reused only after its thread ended
                    return seconds
        return self._cpu_at_end

    def client_handle(self, slots: int = 8) -> ClientHandle:
        """A handle with ``slots`` slots of its own (requests one client process may have in flight at once)."""
        if self._closed:
            raise BatcherClosed("the batcher is closed; make a new one")
        if slots < 1:
            raise InputError(f"slots={slots}: a client needs at least one slot")
        if self._handed + slots > self._capacity:
            raise InputError(f"slots={slots}: {self._capacity - self._handed} of the batcher's {self._capacity} slots "
                             "are left; make the batcher with a larger capacity")
        mine = tuple(range(self._handed, self._handed + slots))
        self._handed += slots
        answers, waker = multiprocessing.get_context("spawn").Pipe(duplex=False)
        self._owners[list(mine)] = len(self._wakers)
        self._wakers.append(waker)
        return ClientHandle(self._memory, self._layout, self._model, mine, answers, self._writer, self.timeout)

    def __enter__(self) -> ProcessBatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, drain: bool = True, timeout: float = 30.0) -> None:
        """Stop: run the requests already sent (``drain``) or fail them with ``BatcherClosed``; later requests fail
        at once. The shared memory is removed (clients attached keep their mapping until they close)."""
        if self._closed:
            return
        self._arrays["closed"][0] = 1
        self._drain = drain
        self._closed = True
        self._thread.join(timeout=timeout)
        if self._thread.is_alive():
            log.warning("the process batcher did not stop within %.0f s", timeout)
            return
        self._read()  # requests that raced the closing flag
        self._reply(self._pending.slots, _CLOSED, "the batcher was closed before this request ran")
        self._pending = self._pending.pick(slice(0, 0))
        self._hang_up()

    def _hang_up(self) -> None:
        """Close the pipes and the memory: a request sent later fails at once (its write finds no reader), and
        spawned clients' waiting callers learn it (their pipes end)."""
        for end in (self._reader, self._writer, self._memory, *self._wakers):
            end.close()
        if self._locked is not None:
            _page_unlock(self._locked, self._device)
            self._locked = None
        with contextlib.suppress(BufferError):  # views still held elsewhere keep the mapping
            self._map.close()

    # -- the batcher's thread --

    def _serve(self) -> None:
        """``_run``, and when it fails (a bug, not a failed batch: those are answered), fail every request instead of
        leaving the clients to their timeouts."""
        running: collections.deque[_Running] = collections.deque()
        try:
            self._run(running)
        except BaseException as err:
            log.exception("the process batcher stopped")
            self._arrays["closed"][0] = 1
            self._closed = True
            text = f"the batcher stopped: {type(err).__name__}: {err}"
            for _, finish, _ in running:  # give the contexts back to the engines
                with contextlib.suppress(Exception):
                    finish()
            with contextlib.suppress(Exception):
                self._read()
            waiting = [self._waiting.slots] if self._waiting is not None else []
            self._reply(np.concatenate([batch.slots for batch, _, _ in running] + [self._pending.slots] + waiting),
                        _FAILED, text)
            self._pending = self._pending.pick(slice(0, 0))
            self._hang_up()
        finally:
            self._cpu_at_end = time.thread_time()

    def _run(self, running: collections.deque[_Running]) -> None:
        """Read requests, start batches (up to ``in_flight`` at once) and answer them, oldest first. While there is
        room for another batch, the thread looks for one until the oldest is done instead of waiting for the GPU
        (with 128 clients and two CNN batches in flight, waiting left the GPU idle until the next batch was
        copied in: 71 % of the bound on an H200). A finished batch's callers are woken before the next batch
        starts while the GPU still runs another (starting one took the thread 0.3-0.4 ms for a small transformer
        on torch on an H200, and every answer of the batch waited for it: 71-76 k req/s from 192 thread clients against
        79-83 k when woken first); with nothing left to run, the next batch starts first, so that the GPU is not
        idle meanwhile."""
        while True:
            while len(running) < self.in_flight:  # fill the engines
                batch = self._next_batch(block=not running)
                if batch is None:
                    if not running:
                        return
                    break
                if not batch:
                    break
                started = self._start(batch, wait=not running)
                if started is not None:
                    running.append(started)
                elif self._waiting is not None:
                    break
            if not running:
                continue
            batch, finish, area = running[0]
            if len(running) < self.in_flight and not is_ready(finish):
                time.sleep(_NAP)  # look again for a batch to start before the GPU is done; one read per nap
                continue
            failure: str | None
            try:  # the answers are in a results area already, or go from the context's buffers into the slots
                failure = finish(lambda outputs, batch=batch, area=area: self._write(batch, outputs, area))
            except Exception as err:  # every caller of the batch learns why; the batcher keeps serving
                failure = f"the batch failed: {err}"
            if failure is not None and area is not None:
                self._readers[area] = None
            running.popleft()
            answered = False
            try:  # answered whatever happens: it is in ``running`` no more, where ``_serve`` would fail it
                if running and not is_ready(running[0][1]):  # the GPU runs another batch meanwhile
                    self._wake_or_fail(batch, failure)
                    answered = True
                if len(running) < self.in_flight:
                    follow = self._next_batch(block=False)
                    if follow:
                        started = self._start(follow, wait=not running)
                        if started is not None:
                            running.append(started)
            finally:
                if not answered:
                    self._wake_or_fail(batch, failure)

    def _wake_or_fail(self, batch: _Requests, failure: str | None) -> None:
        """Wake the callers of a finished batch, or tell them why it failed."""
        if failure is None:
            self._wake(batch.slots)
        else:
            self._reply(batch.slots, _FAILED, failure)

    def _read(self, timeout: float = 0.0) -> None:
        """Move the requests announced in the pipe to ``_pending``, waiting up to ``timeout`` seconds for one."""
        if timeout > 0 and not self._poll.poll(timeout * 1000):
            return
        try:
            data = os.read(self._fd, 1 << 16)
        except BlockingIOError:
            return
        index = np.frombuffer(data, dtype="<i4").astype(np.int64)
        arrays = self._arrays
        new = _Requests(index, arrays["rows"][index], arrays["dims"][index, :len(self._model.dim_names)],
                        arrays["deadline"][index], arrays["submitted"][index])
        self._pending = self._pending.then(new)

    def _feed(self, slot: int, rows: int, key: tuple[int, ...]) -> Any:
        """One request's rows as the checked feed ``start_parts`` takes: views of its slot (no copy until the pinned
        buffers). Kept per slot and shape: the views see each new request's data (building one was 5-10 us per
        request)."""
        from compiler.backends.feeds import CheckedFeed

        if not key:
            feed = CheckedFeed("numpy", {io.name: area[slot, :rows] for io, area in self._in}, rows, {}, ())
        else:
            sizes = dict(zip(self._model.dim_names, key, strict=True))
            feed = CheckedFeed("numpy", {io.name: area[_region(area, slot, rows, _sizes(io, sizes))]
                                         for io, area in self._in}, rows, sizes, key)
        kept = self._feeds[slot]
        if len(kept) >= _FEEDS_PER_SLOT:
            kept.pop(next(iter(kept)))
        kept[(rows, key)] = feed
        return feed

    def _feeds_of(self, batch: _Requests) -> list[Any]:
        """The batch's rows as the checked feeds ``start_parts`` takes: for single-row requests of a small batch one
        feed gathered from the slots (``_GATHER_BYTES``), else one per request (views of its slot)."""
        from compiler.backends.feeds import CheckedFeed

        key = tuple(batch.dims[0].tolist())
        sizes = dict(zip(self._model.dim_names, key, strict=True))
        if batch.rows.max() == 1:
            regions = [(io, area[_region(area, slice(None), 1, _sizes(io, sizes))][:, 0]) for io, area in self._in]
            if sum(len(batch) * region[0].nbytes for _, region in regions) <= _GATHER_BYTES:
                return [CheckedFeed("numpy", {io.name: np.take(region, batch.slots, axis=0) for io, region in regions},
                                    len(batch), sizes, key)]
        feeds = self._feeds
        return [feeds[slot].get((n, key)) or self._feed(slot, n, key)
                for slot, n in zip(batch.slots.tolist(), batch.rows.tolist(), strict=True)]

    def _next_batch(self, block: bool) -> _Requests | None:
        """The requests of the next batch: a full one, or the oldest request's window is over; an empty batch when
        ``block`` is False and none is ready; None when closed and nothing is left."""
        if self._waiting is not None:
            batch, self._waiting = self._waiting, None
            return batch
        while True:
            self._read()
            pending = self._pending
            if not pending:
                if self._closed:
                    return None
                if not block:
                    return pending
                self._read(0.05)  # wakes up now and then to see the batcher closed
                continue
            if self._closed and not self._drain:
                self._reply(pending.slots, _CLOSED, "the batcher was closed before this request ran")
                self._pending = pending.pick(slice(0, 0))
                return None
            now = time.monotonic()
            window_end = float(pending.submitted[0]) + self.max_wait
            if pending.total_rows >= self.max_batch or now >= window_end or self._closed:
                batch = self._take(now)
                if batch or not block:
                    return batch
                continue
            if not block:
                return pending.pick(slice(0, 0))
            # a nap, not a wake-up per request: every announcement would wake a reader of the pipe
            time.sleep(min(window_end - now, _NAP))

    def _take(self, now: float) -> _Requests:
        """Pop the requests of one batch (the oldest request's dims, up to ``max_batch`` rows; a request that does not
        fit leaves room for later smaller ones), answering the expired ones on the way."""
        pending = self._pending
        expired = pending.deadlines < now
        if expired.any():
            self._reply(pending.slots[expired], _EXPIRED,
                        f"the request waited in the queue over its timeout: {_OVERLOADED}")
            pending = pending.pick(~expired)
        if not pending:
            self._pending = pending
            return pending
        same = (pending.dims == pending.dims[0]).all(axis=1)
        chosen = np.flatnonzero(same)
        rows = pending.rows[chosen]
        if (rows == 1).all():
            chosen = chosen[:self.max_batch]
        else:  # first fit, in arrival order
            fits: list[int] = []
            total = 0
            for index, n in zip(chosen.tolist(), rows.tolist(), strict=True):
                if total >= self.max_batch:
                    break
                if total + n <= self.max_batch or not fits:
                    fits.append(index)
                    total += n
            chosen = np.asarray(fits, np.int64)
        taken = np.zeros(len(pending), bool)
        taken[chosen] = True
        self._pending = pending.pick(~taken)
        return pending.pick(chosen)

    def _start(self, batch: _Requests, wait: bool) -> _Running | None:
        """Queue the batch on the engines, its outputs copied into a free results area when there is one. None when
        that failed (its callers have been told why), or when ``wait`` is False and no buffer set was free (it is
        ``_waiting`` then: ``_next_batch`` gives it first)."""
        area = self._free_area()
        try:
            feeds = self._feeds_of(batch)
            if area is None:
                started = self.engines.start_parts(feeds, wait=wait)
            else:
                self._arrays["generation"][area] += 1  # a client still reading the area's last batch learns it
                started = self.engines.start_parts(feeds, wait=wait, out=self._results[area])
        except Exception as err:
            self._reply(batch.slots, _FAILED, f"the batch failed: {err}")
            return None
        if started is None:
            self._waiting = batch
            return None
        if area is not None:
            self._readers[area] = _FILLING
        return batch, started, area

    def _free_area(self) -> int | None:
        """A results area no client reads any more: each read its answer, or the last one's timeout is over."""
        taken = self._arrays["taken"]
        for area, readers in enumerate(self._readers):
            if readers is None:
                return area
            if readers is _FILLING:
                continue
            slots, numbers, until = readers
            if (taken[slots] >= numbers).all() or time.monotonic() > until:  # a slot's next answer counts too
                self._readers[area] = None
                return area
        return None

    def _write(self, batch: _Requests, outputs: Mapping[str, Any], results: int | None = None) -> str | None:
        """Every request's rows of every output into its slot, and its status; the reason when they do not fit.
        Outputs the GPU copied into results area ``results`` stay there: each slot then says where its rows are."""
        arrays = self._arrays
        slots, rows = batch.slots, batch.rows
        if results is not None:
            if self._in_area(outputs, results):
                return self._point(batch, outputs, results)
            self._readers[results] = None  # the engines ran it elsewhere (more rows than a bucket, say)
        arrays["where"][slots, 0] = -1
        self.batches_in_slots += 1
        singles = bool((rows == 1).all())
        for j, (io, area) in enumerate(self._out):
            out = np.asarray(outputs[io.name])
            shape = out.shape[1:]
            if shape == io.largest and singles:  # the common case: whole rows, one fancy assignment
                area[slots, 0] = out
            elif why := _outgrows(io, out.shape):
                return why
            elif singles:
                index: tuple[Any, ...] = (slots, 0, *(slice(0, n) for n in shape))
                area[index] = out
            else:
                offset = 0
                for slot, n in zip(slots.tolist(), rows.tolist(), strict=True):
                    area[_region(area, slot, n, shape)] = out[offset:offset + n]
                    offset += n
            arrays["out_shapes"][slots, j, :len(shape)] = shape
        arrays["status"][slots] = _OK
        arrays["answered"][slots] = arrays["asked"][slots]
        return None

    def _in_area(self, outputs: Mapping[str, Any], area: int) -> bool:
        """Whether every output is a view at the start of its results area (where ``_download`` copied it)."""
        for name, field in self._results[area].items():
            out = outputs[name]
            if not isinstance(out, np.ndarray) or out.__array_interface__["data"][0] != field.__array_interface__[
                    "data"][0]:
                return False
        return True

    def _point(self, batch: _Requests, outputs: Mapping[str, Any], area: int) -> str | None:
        """Answer a batch whose outputs are in results ``area``: each slot gets the area, its first row and the area's
        generation (its client copies the rows out and marks them taken)."""
        arrays = self._arrays
        slots, rows = batch.slots, batch.rows
        for j, (io, _) in enumerate(self._out):
            shape = outputs[io.name].shape
            if why := _outgrows(io, shape):
                return why  # the batch failed: ``_run`` frees the area
            arrays["out_shapes"][slots, j, :len(shape) - 1] = shape[1:]
        where = arrays["where"]
        where[slots, 0] = area
        where[slots, 1] = np.cumsum(rows) - rows
        where[slots, 2] = arrays["generation"][area]
        numbers = arrays["asked"][slots]
        arrays["status"][slots] = _OK
        arrays["answered"][slots] = numbers
        # free once all are read, or past their callers' time (a caller that gave up never reads), and at most
        # ``_UNREAD_HOLD`` from now: a reader later than that gets an error (the generation), not a held area
        self._readers[area] = (slots, numbers, min(float(batch.deadlines.max()) + 2 * _GRACE,
                                                   time.monotonic() + _UNREAD_HOLD))
        self.batches_in_areas += 1
        return None

    def _reply(self, slots: np.ndarray, status: int, text: str) -> None:
        """Answer requests without outputs: an error or expiry, with its message."""
        if not len(slots):
            return
        arrays = self._arrays
        message = np.frombuffer(text.encode("utf-8")[:_ERROR_BYTES - 1].ljust(_ERROR_BYTES, b"\0"), np.uint8)
        arrays["error"][slots] = message
        arrays["status"][slots] = status
        arrays["answered"][slots] = arrays["asked"][slots]
        self._wake(slots)

    def _wake(self, slots: np.ndarray) -> None:
        """Tell the clients their answers are in: one write of slot numbers per client process (its slots in
        arrival order)."""
        owners = self._owners[slots]
        order = np.argsort(owners, kind="stable")
        owners = owners[order]
        data = slots[order].astype("<i4").tobytes()
        cuts = [0, *(np.flatnonzero(owners[1:] != owners[:-1]) + 1).tolist(), len(owners)]
        for start, end in itertools.pairwise(cuts):
            with contextlib.suppress(OSError):  # a client process that is gone: nobody waits for these
                os.write(self._wakers[int(owners[start])].fileno(), data[4 * start:4 * end])


def _outgrows(io: _Io, shape: tuple[int, ...]) -> str | None:
    """Why a batch's output of ``shape`` does not fit the room each slot has per row, or None when it does."""
    rows = shape[1:]
    if len(rows) == len(io.largest) and all(n <= room for n, room in zip(rows, io.largest, strict=True)):
        return None
    return (f"output {io.name!r} has shape {shape}; a slot holds {io.largest} per row (sized by a run at the largest "
            "input sizes): this model's output sizes depend on its data")


def _sizes(io: _Io, values: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else values[d] for d in io.dims)


def _model_of(engines: Any, slot_rows: int) -> _Model:
    """The slots' layout from the engines' spec, the outputs' sizes from one run at the largest input sizes."""

    spec: ModelSpec = engines.spec
    inputs = []
    largest_values = {name: r.max for name, r in spec.dims.items()}
    for i in spec.inputs:
        if not i.dims or i.dims[0] != BATCH_DIM:
            raise InputError(f"input {i} has no batch dimension first; the process batcher serves models whose "
                             "inputs are all batched (use DynamicBatcher in one process for this one)")
        if NUMPY_DTYPES.get(i.dtype) is None:
            raise InputError(f"input {i} is {i.dtype}, which numpy cannot hold in shared memory; export the model "
                             "with float32 or float16 inputs")
        dims = tuple(i.dims[1:])
        inputs.append(_Io(i.name, i.dtype, dims, tuple(d if isinstance(d, int) else largest_values[d] for d in dims)))
    probe = engines(spec.example_feed(1, values={**spec.opt_values(1), **largest_values}))
    if not isinstance(probe, dict):
        probe = {engines.output_names[0]: probe}
    outputs = tuple(_Io(name, str(np.asarray(probe[name]).dtype), tuple(np.asarray(probe[name]).shape[1:]),
                        tuple(np.asarray(probe[name]).shape[1:])) for name in engines.output_names)
    return _Model(tuple(inputs), outputs, tuple(spec.dims), dict(spec.dims), tuple(checks_for(spec)), slot_rows)


def _page_lock(areas: list[np.ndarray], device: Any) -> int | None:
    """Page-lock the results areas (``cudaHostRegister``, one range: they are the last fields of the layout, from a
    page on) so that the GPU copies into them at full speed and without holding the host: the range's address, or
    None when CUDA refuses (the answers then go through the context's own pinned buffers into the slots). From a
    thread of its own: a refusal leaves CUDA's last error set on the calling thread, where torch's next check of a
    kernel launch would report it. In ``device``'s context (the engines' GPU; None: the current one)."""
    import torch

    if not torch.cuda.is_available():  # engines that say they queue on a GPU, on a machine without one (tests)
        return None
    start = min(a.__array_interface__["data"][0] for a in areas)
    end = max(a.__array_interface__["data"][0] + a.nbytes for a in areas)
    result: list[Any] = []

    def register() -> None:
        with _on(device):  # a new thread's current device is 0
            result.append(torch.cuda.cudart().cudaHostRegister(start, end - start, 1))  # 1: portable

    thread = threading.Thread(target=register, name="trtc-page-lock")
    thread.start()
    thread.join()
    error = result[0] if result else "no answer (see the thread's exception above)"
    if getattr(error, "value", error) != 0:
        log.info("CUDA cannot page-lock the batcher's results areas (%s); answers are copied into the slots", error)
        return None
    return start


def _page_unlock(address: int, device: Any) -> None:
    import torch

    with _on(device):
        torch.cuda.cudart().cudaHostUnregister(address)


def _on(device: Any) -> contextlib.AbstractContextManager[Any]:
    """``torch.cuda.device(device)``, or nothing for None (the current device)."""
    import torch

    return contextlib.nullcontext() if device is None else torch.cuda.device(device)


def _takes_out(engines: Any) -> bool:
    """Whether ``engines.start_parts`` takes ``out`` (results areas to copy the outputs into)."""
    import inspect

    try:
        return "out" in inspect.signature(engines.start_parts).parameters
    except (TypeError, ValueError):
        return False


def _shared_memory(size: int, directory: str | None) -> tuple[Any, mmap.mmap]:
    """``size`` bytes of shared memory: a file in ``/dev/shm`` removed at once (its descriptor, as a multiprocessing
    Connection, travels to the clients, so nothing is left behind even after a crash), its pages reserved now:
    writing into a tmpfs beyond its limit is a SIGBUS, not an error."""
    from multiprocessing.connection import Connection

    directory = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    fd, path = tempfile.mkstemp(prefix=f"trtc-batcher-{os.getpid()}-", dir=directory)
    os.unlink(path)
    try:
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as err:
            free = os.statvfs(directory)
            raise InputError(f"{directory} has {free.f_bavail * free.f_frsize / 2**20:.0f} MiB free and the batcher's "
                             f"slots need {size / 2**20:.0f} MiB ({err.strerror}): lower capacity or slot_rows, or "
                             "give the container more shared memory (docker run --shm-size)") from None
        return Connection(fd), mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
