"""The serving side of a process batcher: ``ProcessBatcher``, one thread that reads the clients' requests from the
shared memory, runs them in batches on the engines and answers them (see ``compiler.serve.processes``)."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import itertools
import logging
import multiprocessing
import os
import select
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.core import defaults
from compiler.core.errors import InputError
from compiler.serve.batching import BatchPolicy, is_ready
from compiler.serve.processes.client import ClientHandle
from compiler.serve.processes.layout import (
    ERROR_BYTES,
    GRACE,
    OVERLOADED,
    STATUS_CLOSED,
    STATUS_EXPIRED,
    STATUS_FAILED,
    STATUS_OK,
    Layout,
    SlotIo,
    regions,
    shared_memory,
    slot_index,
    slot_model,
)
from compiler.serve.processes.page_lock import page_lock, page_unlock
from compiler.serve.waits import BatcherClosed

__all__ = ["ProcessBatcher"]

log = logging.getLogger(__name__)

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
                 max_wait_ms: float = defaults.MAX_WAIT_MS, timeout: float | None = 10.0, in_flight: int | None = None,
                 shm_dir: str | None = None) -> None:
        if capacity < 1 or slot_rows < 1:
            raise InputError(f"capacity={capacity}, slot_rows={slot_rows}: both must be at least 1")
        policy = BatchPolicy.of(engines.buckets, max_batch, max_wait_ms, timeout)
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
        self._policy = policy  # when a batch is ready and which requests it takes (``compiler.serve.batching``)
        self.timeout = timeout
        self._model = slot_model(engines, slot_rows)
        # on a GPU the outputs are copied into results areas of the shared memory: one per batch in flight, and two
        # whose clients are still reading (engines that take ``start_parts(out=...)``)
        areas = in_flight + 2 if RESULTS_AREAS and getattr(engines, "queues_on_gpu", False) and _takes_out(
            engines) else 0
        self._layout = Layout.of(regions(self._model, capacity, areas, policy.max_batch))
        self._memory, self._map = shared_memory(self._layout.size, shm_dir)
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
            self._locked = page_lock(list(fields.values()), self._device)
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
    def max_batch(self) -> int:
        """Rows per batch at most."""
        return self._policy.max_batch

    @property
    def max_wait(self) -> float:
        """Seconds the first request of the queue waits for company (``max_wait_ms`` / 1000)."""
        return self._policy.max_wait

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
        self._reply(self._pending.slots, STATUS_CLOSED, "the batcher was closed before this request ran")
        self._pending = self._pending.pick(slice(0, 0))
        self._hang_up()

    def _hang_up(self) -> None:
        """Close the pipes and the memory: a request sent later fails at once (its write finds no reader), and
        spawned clients' waiting callers learn it (their pipes end)."""
        for end in (self._reader, self._writer, self._memory, *self._wakers):
            end.close()
        if self._locked is not None:
            page_unlock(self._locked, self._device)
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
                        STATUS_FAILED, text)
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
            self._reply(batch.slots, STATUS_FAILED, failure)

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
        buffers). Kept per slot and shape: the views see each new request's data (building one costs 5-10 us per
        request)."""
        from compiler.backends.feeds import CheckedFeed

        if not key:
            feed = CheckedFeed("numpy", {io.name: area[slot, :rows] for io, area in self._in}, rows, {}, ())
        else:
            sizes = dict(zip(self._model.dim_names, key, strict=True))
            feed = CheckedFeed("numpy", {io.name: area[slot_index(slot, rows, _sizes(io, sizes))]
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
            regions = [(io, area[slot_index(slice(None), 1, _sizes(io, sizes))][:, 0]) for io, area in self._in]
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
                self._reply(pending.slots, STATUS_CLOSED, "the batcher was closed before this request ran")
                self._pending = pending.pick(slice(0, 0))
                return None
            now = time.monotonic()
            first = float(pending.submitted[0])
            if self._closed or self._policy.ready(pending.total_rows, first, now):
                batch = self._take(now)
                if batch or not block:
                    return batch
                continue
            if not block:
                return pending.pick(slice(0, 0))
            # a nap, not a wake-up per request: every announcement would wake a reader of the pipe
            time.sleep(min(self._policy.window_end(first) - now, _NAP))

    def _take(self, now: float) -> _Requests:
        """Pop the requests of one batch (``BatchPolicy.take``: the first request's dims, first fit up to
        ``max_batch`` rows), answering the expired ones."""
        pending = self._pending
        taken = self._policy.take(pending.rows, pending.dims, pending.deadlines, now)
        if len(taken.expired):
            self._reply(pending.slots[taken.expired], STATUS_EXPIRED,
                        f"the request waited in the queue over its timeout: {OVERLOADED}")
        self._pending = pending.pick(taken.left)
        return pending.pick(taken.batch)

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
            self._reply(batch.slots, STATUS_FAILED, f"the batch failed: {err}")
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
                    area[slot_index(slot, n, shape)] = out[offset:offset + n]
                    offset += n
            arrays["out_shapes"][slots, j, :len(shape)] = shape
        arrays["status"][slots] = STATUS_OK
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
        arrays["status"][slots] = STATUS_OK
        arrays["answered"][slots] = numbers
        # free once all are read, or past their callers' time (a caller that gave up never reads), and at most
        # ``_UNREAD_HOLD`` from now: a reader later than that gets an error (the generation), not a held area
        self._readers[area] = (slots, numbers, min(float(batch.deadlines.max()) + 2 * GRACE,
                                                   time.monotonic() + _UNREAD_HOLD))
        self.batches_in_areas += 1
        return None

    def _reply(self, slots: np.ndarray, status: int, text: str) -> None:
        """Answer requests without outputs: an error or expiry, with its message."""
        if not len(slots):
            return
        arrays = self._arrays
        message = np.frombuffer(text.encode("utf-8")[:ERROR_BYTES - 1].ljust(ERROR_BYTES, b"\0"), np.uint8)
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


def _outgrows(io: SlotIo, shape: tuple[int, ...]) -> str | None:
    """Why a batch's output of ``shape`` does not fit the room each slot has per row, or None when it does."""
    rows = shape[1:]
    if len(rows) == len(io.largest) and all(n <= room for n, room in zip(rows, io.largest, strict=True)):
        return None
    return (f"output {io.name!r} has shape {shape}; a slot holds {io.largest} per row (sized by a run at the largest "
            "input sizes): this model's output sizes depend on its data")


def _sizes(io: SlotIo, values: Mapping[str, int]) -> tuple[int, ...]:
    return tuple(d if isinstance(d, int) else values[d] for d in io.dims)


def _takes_out(engines: Any) -> bool:
    """Whether ``engines.start_parts`` takes ``out`` (results areas to copy the outputs into)."""
    try:
        return "out" in inspect.signature(engines.start_parts).parameters
    except (TypeError, ValueError):
        return False
