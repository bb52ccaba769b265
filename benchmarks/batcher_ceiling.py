"""The dynamic batcher's own ceiling on this host: requests per second with answers that cost nothing.

``DynamicBatcher`` over an ``engines`` that answers every batch at once from stored outputs
(``serving_measure.InstantEngines``), so what is timed is the batcher's Python work per request and its
hand-offs: closed-loop clients of single-row requests, each sending its next when answered, in
three modes: ``--threads`` client threads blocking in ``submit``, ``--coroutines`` coroutines of
one asyncio event loop awaiting ``infer``, and as many client threads spread over ``--processes``
other processes sending to a ``ProcessBatcher`` (``compiler.serve.processes``), and as many
coroutines there (one event loop per process) awaiting ``BatcherClient.infer``. Batches of up to
64 rows, ``max_wait_ms`` 5. Each mode runs ``--repeats`` times; the table shows the median (a
shared machine is noisy). A model whose largest bucket runs faster than this ceiling cannot be
served at its bound through the batcher on this host. On a GPU machine ``serving_gpu.py``
measures the same ceiling beside the real backends.

    python benchmarks/batcher_ceiling.py --out benchmarks/results/batcher_ceiling.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import process_clients  # noqa: E402
from benchmarks.serving_measure import InstantEngines, in_threads  # noqa: E402

BATCH = 64


def instant_engines() -> Any:
    """A 1x8x8 -> 10 model's interface answering at once (the model itself never runs)."""
    import torch

    from compiler.serve.load import engines_from_module

    module = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10))
    engines = engines_from_module(module, ["images:Bx1x8x8"], buckets=(1, 16, BATCH), device="cpu", contexts=1)
    return InstantEngines(engines, {engines.output_names[0]: np.zeros((BATCH, 10), np.float32)})


def with_threads(engines: Any, clients: int, requests: int) -> float:
    from compiler.serve.batcher import DynamicBatcher

    x = np.zeros((1, 1, 8, 8), np.float32)
    issued = 0
    lock = threading.Lock()

    def client() -> None:
        nonlocal issued
        while True:
            with lock:
                if issued >= requests:
                    return
                issued += 1
            batcher.submit(x, timeout=30.0)

    with DynamicBatcher(engines, max_wait_ms=5, max_batch=BATCH) as batcher:
        return requests / in_threads(lambda _: client(), clients)


def with_asyncio(engines: Any, clients: int, requests: int) -> float:
    from compiler.serve.batcher import DynamicBatcher

    x = np.zeros((1, 1, 8, 8), np.float32)
    issued = 0

    async def client(batcher: DynamicBatcher) -> None:
        nonlocal issued
        while issued < requests:
            issued += 1
            await batcher.infer(x, timeout=30.0)

    async def clients_of(batcher: DynamicBatcher) -> None:
        await asyncio.gather(*(client(batcher) for _ in range(clients)))

    with DynamicBatcher(engines, max_wait_ms=5, max_batch=BATCH) as batcher:
        start = time.perf_counter()
        asyncio.run(clients_of(batcher))
        return requests / (time.perf_counter() - start)


def with_processes(engines: Any, clients: int, requests: int, processes: int, kind: str = "threads") -> float:
    from compiler.serve.processes import ProcessBatcher

    x = np.zeros((1, 1, 8, 8), np.float32)
    with ProcessBatcher(engines, capacity=clients, max_wait_ms=5, max_batch=BATCH) as batcher:
        ran = process_clients.run(batcher, [x] * clients, requests, processes, kind=kind)
    return requests / ran["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="The JSON to write.")
    parser.add_argument("--threads", type=int, default=64, help="Client threads (default 64).")
    parser.add_argument("--coroutines", type=int, default=128, help="Client coroutines (default 128).")
    parser.add_argument("--processes", type=int, help="Client processes for the ProcessBatcher row (default: the "
                        "cores less 4, at least 2); its clients are --coroutines threads in all.")
    parser.add_argument("--requests", type=int, default=20000, help="Requests per run (default 20000).")
    parser.add_argument("--repeats", type=int, default=3, help="Runs per mode (default 3).")
    args = parser.parse_args()

    import os

    from rich.console import Console
    from rich.table import Table

    engines = instant_engines()
    processes = args.processes or process_clients.default_processes(args.coroutines)
    runs: dict[str, list[float]] = {"threads": [], "asyncio": [], "processes": [], "processes-asyncio": []}
    for _ in range(args.repeats):
        runs["threads"].append(with_threads(engines, args.threads, args.requests))
        runs["asyncio"].append(with_asyncio(engines, args.coroutines, args.requests))
        runs["processes"].append(with_processes(engines, args.coroutines, args.requests, processes))
        runs["processes-asyncio"].append(with_processes(engines, args.coroutines, args.requests, processes, "asyncio"))
    table = Table("clients", "count", "median req/s", "runs", title="the batcher's own ceiling (instant answers)")
    for mode, count in (("threads", args.threads), ("asyncio", args.coroutines), ("processes", args.coroutines),
                        ("processes-asyncio", args.coroutines)):
        table.add_row(mode, str(count), f"{statistics.median(runs[mode]):,.0f}",
                      ", ".join(f"{r:,.0f}" for r in runs[mode]))
    Console(width=None if sys.stdout.isatty() else 120).print(table)
    report = {"kind": "trtc-batcher-ceiling", "command": " ".join(sys.argv),
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "cpus": os.cpu_count()},
              "settings": {"threads": args.threads, "coroutines": args.coroutines, "requests": args.requests,
                           "client_processes": processes,
                           "max_batch": BATCH, "max_wait_ms": 5},
              "requests_per_s": runs, "median": {m: statistics.median(r) for m, r in runs.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
