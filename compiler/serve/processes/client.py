"""The client side of a process batcher: ``ClientHandle`` (what a client process is given) and ``BatcherClient``
(what it sends requests through). Numpy and the standard library only: never torch or ONNX Runtime."""

from __future__ import annotations

import asyncio
import contextlib
import math
import mmap
import os
import queue
import threading
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.core.errors import FeedError, InputError
from compiler.serve.processes.layout import (
    GRACE,
    OVERLOADED,
    STATUS_CLOSED,
    STATUS_EXPIRED,
    STATUS_OK,
    Layout,
    SlotModel,
    slot_index,
)
from compiler.serve.waits import BatcherClosed, OverdueWaits, RequestTimeout

__all__ = ["BatcherClient", "ClientHandle", "RequestFailed"]

_GONE = "the batcher is closed, or its process ended; restart the server"


class RequestFailed(RuntimeError):
    """The request's batch failed in the serving process (its message says why)."""


@dataclass
class ClientHandle:
    """What a client process needs to reach a ``ProcessBatcher``: pass it to a process started by ``multiprocessing``
    (as an argument), then call ``connect()`` there. Its slots are its own: one handle per process."""

    memory: Any  # the shared memory's descriptor (a multiprocessing Connection: it travels to spawned processes)
    layout: Layout
    model: SlotModel
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
        self._names = [io.name for io in self._model.inputs]
        self._arrays = handle.layout.views(self._map)
        self._inputs = [(io, self._arrays[f"in:{io.name}"]) for io in self._model.inputs]  # the slots' input areas
        self._outputs = [(io, self._arrays[f"out:{io.name}"]) for io in self._model.outputs]
        self._results = [self._arrays.get(f"res:{io.name}") for io in self._model.outputs]  # see ``regions``
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
        self._overdue = OverdueWaits(OVERLOADED)
        self._lock = threading.Lock()
        self._answers = handle.answers.fileno()
        self._gone = False  # the batcher's process ended (its end of the answers' pipe closed)
        threading.Thread(target=self._wake_callers, name="trtc-batcher-client", daemon=True).start()

    @property
    def input_names(self) -> list[str]:
        return list(self._names)

    @property
    def output_names(self) -> list[str]:
        return [io.name for io in self._model.outputs]

    def submit(self, x: Any, *, timeout: float | None = None) -> Any:
        """Run one request through the batcher and return its outputs. Raises ``FeedError`` at once for a request
        that does not fit the model, ``RequestTimeout``, ``BatcherClosed``, or ``RequestFailed`` when its batch
        failed. ``timeout`` (default: the batcher's) counts from the call; the batcher answers every request by
        then (an expired one without running it) or with its batch, and the caller waits ``GRACE`` seconds more
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
            left = end + GRACE - time.monotonic()
            if not ready.acquire(timeout=-1 if limit is None else max(0.0, left)):
                with self._lock:
                    self._abandoned.add(slot)
                raise RequestTimeout(f"no answer within {(limit or 0) * 1000:.0f} ms: {OVERLOADED}")
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
            overdue = None if limit is None else self._overdue.add(loop, future, limit, end + GRACE)
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
        model = self._model
        single = not isinstance(x, Mapping)
        call = model.checker.check(x, single)  # as ``Engines`` checks its feeds (``compiler.backends.feeds``)
        if call.kind == "cuda":
            name, value = next(iter(call.arrays.items()))
            raise FeedError(f"input {name!r} is a {type(value).__name__} that is not host memory; pass a numpy array "
                            "or a CPU tensor")
        if call.rows > model.slot_rows:
            raise FeedError(f"the request has {call.rows} rows and a slot holds {model.slot_rows}: split it, or make "
                            f"the batcher with slot_rows={call.rows}")
        self._check_open()
        return limit, single, [call.arrays[name] for name in self._names], call.rows, list(call.key)

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
                area[slot_index(slot, rows, array.shape[1:])] = array
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
        if status != STATUS_OK:
            text = bytes(arrays["error"][slot]).rstrip(b"\0").decode("utf-8", "replace")
            if status == STATUS_EXPIRED:
                raise RequestTimeout(text)
            if status == STATUS_CLOSED:
                raise BatcherClosed(text)
            raise RequestFailed(text)
        shapes = arrays["out_shapes"][slot]
        results, first, generation = arrays["where"][slot].tolist()
        outputs = {}
        for j, (io, area) in enumerate(self._outputs):
            shape = tuple(shapes[j, :len(io.largest)].tolist())
            if results < 0:  # the batcher wrote the answer into the slot
                outputs[io.name] = np.array(area[slot_index(slot, rows, shape)])
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
