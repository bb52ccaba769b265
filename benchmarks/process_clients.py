"""Closed-loop clients in other processes for a ``ProcessBatcher`` (``serving_gpu.py``, ``batcher_ceiling.py``).

``processes`` spawned processes share ``clients`` clients, threads calling ``submit`` or (``kind``
"asyncio") coroutines of one event loop per process awaiting ``infer``; each client sends one
request, waits for its answer, and sends the next, until its process has answered its share of
``requests``. Every client sends its own row (``inputs[i]``), so that the caller can check that each
answer is the client's own. The processes start together (an event) and report their latencies,
when each answer came, the first values of every answer and the requests they lost; seconds run from
the first start to the last end (CLOCK_MONOTONIC is one clock for all processes). The steady rate
and the steady latencies count only the answers while every process was sending: a process that
is done with its share leaves fewer clients to fill the last batches, which then wait out the
batcher's ``max_wait`` for company that never comes.

The child processes import numpy and ``compiler.serve.processes`` only (never torch).
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

FIRST_VALUES = 64  # values of each answer sent back for the misrouting check


def default_processes(clients: int) -> int:
    """Client processes: the cores the serving process does not need (about 4), at least 2, at most ``clients``."""
    return max(1, min(clients, max(2, (os.cpu_count() or 2) - 4)))


def run(batcher: Any, inputs: list[Any], requests: int, processes: int, timeout: float = 30.0,
        kind: str = "threads", seconds: float | None = None) -> dict[str, Any]:
    """Run ``len(inputs)`` clients in ``processes`` processes against ``batcher`` until ``requests`` are answered
    (or, with ``seconds``, until that long after the start, whichever comes first: no client sends after it).

    Returns seconds, latencies (s) of every answer and of those while every process sent (``steady``),
    answers as (client index, first values), lost requests and the CPU time the client processes used while they
    sent."""
    clients = len(inputs)
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Event()
    results = spawn.Queue()
    groups = [list(range(p, clients, processes)) for p in range(processes)]
    shares = [requests // processes + (1 if p < requests % processes else 0) for p in range(processes)]
    workers = [spawn.Process(target=_client_process, daemon=True,
                             args=(batcher.client_handle(len(group)), group, [inputs[i] for i in group], share,
                                   timeout, start, results, kind, seconds))
               for group, share in zip(groups, shares, strict=True) if group]
    for worker in workers:
        worker.start()
    ready = [results.get(timeout=120) for _ in workers]  # each says it is attached and waiting
    assert all(r == "ready" for r in ready), ready
    start.set()
    reports = [results.get(timeout=600) for _ in workers]
    for worker in workers:
        worker.join(timeout=30)
    failures = [r["error"] for r in reports if r.get("error")]
    if failures:
        raise RuntimeError(f"a client process failed: {failures[0]}")
    latencies = np.concatenate([r["latencies"] for r in reports])
    answers = [pair for r in reports for pair in r["answers"]]
    rate, steady_latencies = steady(reports)
    return {"seconds": max(r["end"] for r in reports) - min(r["begin"] for r in reports),
            "steady_requests_per_s": rate, "steady_latencies": steady_latencies,
            "latencies": latencies, "answers": answers, "lost": sum(r["lost"] for r in reports),
            "processes": len(workers), "cpu_seconds": sum(r["cpu"] for r in reports)}


def steady(reports: list[dict[str, Any]]) -> tuple[float | None, np.ndarray]:
    """Answers per second while every process was sending, from the last process's start to the first one's end
    (None when that span is empty or holds no answer), and those answers' latencies (empty exactly then)."""
    span = _steady_span(reports)
    if span is None:
        return None, np.zeros(0)
    kept = [_in_span(r["ends"], span) for r in reports]
    latencies = np.concatenate([np.asarray(r["latencies"])[k] for r, k in zip(reports, kept, strict=True)])
    return (len(latencies) / (span[1] - span[0]), latencies) if len(latencies) else (None, latencies)


def _steady_span(reports: list[dict[str, Any]]) -> tuple[float, float] | None:
    first, last = max(r["begin"] for r in reports), min(r["end"] for r in reports)
    return (first, last) if last > first else None


def _in_span(ends: Any, span: tuple[float, float]) -> np.ndarray:
    ends = np.asarray(ends, dtype=float)
    return (ends >= span[0]) & (ends <= span[1])


def _client_process(handle: Any, indices: list[int], inputs: list[Any], share: int, timeout: float,
                    start: Any, results: Any, kind: str, seconds: float | None = None) -> None:
    """One client process: ``len(indices)`` threads (or coroutines), ``share`` requests in all."""
    try:
        client = handle.connect()
    except BaseException as err:
        results.put("ready")
        results.put({"error": f"{type(err).__name__}: {err}"})
        return
    loop = ClosedLoop(share)
    results.put("ready")
    start.wait()
    begin = time.monotonic()
    if seconds is not None:
        loop.until = begin + seconds
    cpu = time.process_time()
    if kind == "asyncio":
        loop.in_asyncio(lambda x: client.infer(x, timeout=timeout), inputs, indices)
    else:
        loop.in_threads(lambda x: client.submit(x, timeout=timeout), inputs, indices)
    end = time.monotonic()
    cpu = time.process_time() - cpu
    client.close()
    results.put({"begin": begin, "end": end, "latencies": np.asarray(loop.latencies), "ends": np.asarray(loop.ends),
                 "answers": loop.answers, "lost": loop.lost, "cpu": cpu})


class ClosedLoop:
    """Closed-loop clients, one per input: each sends its input, waits for the answer and sends it again, until
    ``requests`` are sent in all; a failed request is counted as lost and the run goes on. Keeps each answer's
    latency, when it came (``time.monotonic``) and its first values (``first_values``), checked after the run so
    that checking costs the clients nothing. ``in_threads``: a thread per client calling ``send``;
    ``in_asyncio``: a coroutine per client awaiting ``send``, in one event loop.

    The threads share no lock per request: a shared one, taken twice per request, had the load generator's threads
    wait for each other as well as for their answers. ``next`` on a count and ``list.append`` are atomic under the
    GIL, and each answer's time and latency go into one list in one append (two lists could pair one thread's end
    with another's latency)."""

    def __init__(self, requests: int, until: float = float("inf")) -> None:
        self.requests = requests
        self.until = until  # time.monotonic() after which no client sends
        self.done: list[tuple[float, float]] = []  # per answer: when it came, its latency
        self.answers: list[tuple[int, np.ndarray]] = []  # (client index, first values of its answer)
        self.lost = 0
        self._issued = 0

    @property
    def latencies(self) -> list[float]:
        return [latency for _, latency in self.done]

    @property
    def ends(self) -> list[float]:
        return [end for end, _ in self.done]

    def in_threads(self, send: Callable[[Any], Any], inputs: list[Any], indices: list[int]) -> None:
        issued = itertools.count()
        failing = threading.Lock()  # taken only when a request fails
        done, answers = self.done, self.answers
        clock, requests = time.monotonic, self.requests

        def client(position: int) -> None:
            x, index = inputs[position], indices[position]
            while next(issued) < requests and clock() < self.until:
                begin = clock()
                try:
                    out = send(x)
                except Exception:
                    with failing:
                        self.lost += 1
                    continue
                end = clock()
                done.append((end, end - begin))
                answers.append((index, first_values(out)))

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(inputs))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def in_asyncio(self, send: Callable[[Any], Awaitable[Any]], inputs: list[Any], indices: list[int]) -> None:
        async def client(position: int) -> None:
            x, index = inputs[position], indices[position]
            while self._issued < self.requests and time.monotonic() < self.until:
                self._issued += 1
                begin = time.monotonic()
                try:
                    out = await send(x)
                except Exception:
                    self.lost += 1
                    continue
                end = time.monotonic()
                self.done.append((end, end - begin))
                self.answers.append((index, first_values(out)))

        async def clients() -> None:
            await asyncio.gather(*(client(i) for i in range(len(inputs))))

        asyncio.run(clients())


def first_values(out: Any) -> np.ndarray:
    """The first ``FIRST_VALUES`` values of an answer's first output, as a float32 copy (a view would keep the
    batch alive)."""
    first = next(iter(out.values())) if isinstance(out, dict) else out
    return np.asarray(first).reshape(-1)[:FIRST_VALUES].astype(np.float32)
