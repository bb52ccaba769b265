"""Closed-loop clients in other processes for a ``ProcessBatcher`` (``serving_gpu.py``, ``batcher_ceiling.py``).

``processes`` spawned processes share ``clients`` clients, threads calling ``submit`` or (``kind``
"asyncio") coroutines of one event loop per process awaiting ``infer``; each client sends one
request, waits for its answer, and sends the next, until its process has answered its share of
``requests``. Every client sends its own row (``inputs[i]``), so that the caller can check that each
answer is the client's own. The processes start together (an event) and report their latencies,
the first values of every answer and the requests they lost; seconds run from the first start to the
last end (CLOCK_MONOTONIC is one clock for all processes).

The child processes import numpy and ``compiler.serve.processes`` only (never torch).
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import threading
import time
from typing import Any

import numpy as np

FIRST_VALUES = 64  # values of each answer sent back for the misrouting check


def default_processes(clients: int) -> int:
    """Client processes: the cores the serving process does not need (about 4), at least 2, at most ``clients``."""
    return max(1, min(clients, max(2, (os.cpu_count() or 2) - 4)))


def run(batcher: Any, inputs: list[Any], requests: int, processes: int, timeout: float = 30.0,
        kind: str = "threads") -> dict[str, Any]:
    """Run ``len(inputs)`` clients in ``processes`` processes against ``batcher`` until ``requests`` are answered.

    Returns seconds, latencies (s), answers as (client index, first values) and lost requests."""
    clients = len(inputs)
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Event()
    results = spawn.Queue()
    groups = [list(range(p, clients, processes)) for p in range(processes)]
    shares = [requests // processes + (1 if p < requests % processes else 0) for p in range(processes)]
    workers = [spawn.Process(target=_client_process, daemon=True,
                             args=(batcher.client_handle(len(group)), group, [inputs[i] for i in group], share,
                                   timeout, start, results, kind))
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
    return {"seconds": max(r["end"] for r in reports) - min(r["begin"] for r in reports),
            "latencies": latencies, "answers": answers, "lost": sum(r["lost"] for r in reports),
            "processes": len(workers)}


def _client_process(handle: Any, indices: list[int], inputs: list[Any], share: int, timeout: float,
                    start: Any, results: Any, kind: str) -> None:
    """One client process: ``len(indices)`` threads (or coroutines), ``share`` requests in all."""
    try:
        client = handle.connect()
    except BaseException as err:
        results.put("ready")
        results.put({"error": f"{type(err).__name__}: {err}"})
        return
    latencies: list[float] = []
    answers: list[tuple[int, np.ndarray]] = []
    lost = 0
    issued = 0
    lock = threading.Lock()

    def one(position: int) -> None:
        nonlocal issued, lost
        x = inputs[position]
        index = indices[position]
        while True:
            with lock:
                if issued >= share:
                    return
                issued += 1
            begin = time.perf_counter()
            try:
                out = client.submit(x, timeout=timeout)
            except Exception:  # counted as lost; the run goes on
                with lock:
                    lost += 1
                continue
            elapsed = time.perf_counter() - begin
            first = out if not isinstance(out, dict) else next(iter(out.values()))
            with lock:
                latencies.append(elapsed)
                answers.append((index, first.reshape(-1)[:FIRST_VALUES].astype(np.float32)))

    async def one_async(position: int) -> None:
        nonlocal issued, lost
        x = inputs[position]
        index = indices[position]
        while issued < share:
            issued += 1
            begin = time.perf_counter()
            try:
                out = await client.infer(x, timeout=timeout)
            except Exception:
                lost += 1
                continue
            latencies.append(time.perf_counter() - begin)
            first = out if not isinstance(out, dict) else next(iter(out.values()))
            answers.append((index, first.reshape(-1)[:FIRST_VALUES].astype(np.float32)))

    async def all_async() -> None:
        await asyncio.gather(*(one_async(i) for i in range(len(inputs))))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(inputs))]
    results.put("ready")
    start.wait()
    begin = time.monotonic()
    if kind == "asyncio":
        asyncio.run(all_async())
    else:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    end = time.monotonic()
    client.close()
    results.put({"begin": begin, "end": end, "latencies": np.asarray(latencies), "answers": answers, "lost": lost})
