"""What a caller waiting on a batcher can be told, and the one look per event loop that fails overdue waits.

Shared by both batchers: ``DynamicBatcher`` (``compiler.serve.batcher``) and the process batcher's clients
(``compiler.serve.processes``), which import numpy and this only (never torch or ONNX Runtime).
"""

from __future__ import annotations

import asyncio
import time
import weakref
from typing import Any

__all__ = ["SWEEP", "BatcherClosed", "OverdueWaits", "RequestTimeout"]

SWEEP = 0.01  # seconds between an event loop's looks for ``infer`` requests past their timeout


class RequestTimeout(TimeoutError):
    """A request was not answered within its timeout (the server is overloaded or stuck)."""


class BatcherClosed(RuntimeError):
    """The batcher was closed before the request ran."""


class OverdueWaits:
    """The ``infer`` waits of every event loop awaiting one batcher's answers (``DynamicBatcher``, or a
    ``BatcherClient`` of a process batcher): one ``_Overdue`` per loop, each waiting future failed with
    ``RequestTimeout`` once its time is over. Held weakly both ways (the waits hold their futures, which hold the
    loop): the waiting ``infer`` calls and the scheduled look keep a loop's ``_Overdue``.

    One look per event loop every ``SWEEP`` seconds rather than a timer per request: a timer handle per request
    cost a fifth of the loop's time per request (76 k against 95 k req/s, ``benchmarks/batcher_ceiling.py``'s
    asyncio mode with 128 coroutines on a development machine), ``asyncio.timeout``'s context manager and task
    cancellation a third; in a client process, an asyncio timer per request cost a quarter of its time."""

    def __init__(self, advice: str) -> None:
        self._advice = advice  # what the timeout's message tells the user to do
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, weakref.ref[_Overdue]] = (
            weakref.WeakKeyDictionary())

    def add(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], limit: float,
            due: float) -> _Overdue:
        """Fail ``future`` with "no answer within ``limit``" once ``time.monotonic()`` passes ``due``, unless it is
        done by then; ``drop`` it from what this returns once it is."""
        kept = self._by_loop.get(loop)
        overdue = kept() if kept is not None else None
        if overdue is None:
            overdue = _Overdue(self._advice)
            self._by_loop[loop] = weakref.ref(overdue)
        overdue.add(loop, future, limit, due)
        return overdue


class _Overdue:
    """The ``infer`` requests of one event loop waiting for their answers; touched on that loop only. While any
    waits, one callback every ``SWEEP`` seconds fails those past their time. The waits are kept by the ``SWEEP``
    tick they fall due in, so that adding and dropping one costs two dict operations and a look goes over the
    ticks since the last look only (a look over every waiting request cost 2 us per request a second of waiting,
    as much as the timer it replaces, when a server is overloaded), and a dropped (answered) wait keeps nothing
    alive."""

    def __init__(self, advice: str) -> None:
        self.live: dict[asyncio.Future[Any], int] = {}  # future -> the tick it falls due in
        self._ticks: dict[int, dict[asyncio.Future[Any], tuple[float, float]]] = {}  # tick -> {future: (due, limit)}
        self._next = 0  # the first tick the next look goes over
        self._advice = advice
        self._armed = False

    def add(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future[Any], limit: float, due: float) -> None:
        tick = int(due // SWEEP)
        self._ticks.setdefault(tick, {})[future] = (due, limit)
        self.live[future] = tick
        self._next = min(self._next, tick) if self._armed else tick
        if not self._armed:
            self._armed = True
            loop.call_later(SWEEP, self._sweep, loop)

    def drop(self, future: asyncio.Future[Any]) -> None:
        tick = self.live.pop(future, None)
        if tick is None:
            return
        waits = self._ticks[tick]
        del waits[future]
        if not waits:
            del self._ticks[tick]

    def _sweep(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            now = time.monotonic()
            last = int(now // SWEEP)
            for tick in range(self._next, last + 1):
                waits = self._ticks.get(tick)
                if not waits:
                    continue
                for future, (due, limit) in list(waits.items()):
                    if due > now:  # the last tick's later part
                        continue
                    del waits[future]
                    del self.live[future]
                    if not future.done():  # a request still queued is then dropped (``_Request.start``)
                        future.set_exception(RequestTimeout(f"no answer within {limit * 1000:.0f} ms: {self._advice}"))
                if not waits:
                    del self._ticks[tick]
            self._next = last
        finally:  # re-armed whatever happened, or no later timeout of this loop would fire
            self._armed = bool(self.live)
            if self._armed:
                loop.call_later(SWEEP, self._sweep, loop)
