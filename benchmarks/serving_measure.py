"""What ``serving_gpu.py`` measures, one function per measurement: ``engines(x)`` back to back (the bound), the
batchers with closed-loop clients (``batcher_run``: threads, coroutines, or clients in other processes through
``ProcessBatcher``), ``run_parts``, concurrent calls, and ``map`` against the plain loop (``map_run``), with the
engines wrapped to count the rows they run (``CountingEngines``) or to answer at once (``InstantEngines``: the
batchers' own ceiling). ``serving_cpu_model.py`` runs the same measurements on a CPU model of the GPU path.
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks import process_clients
from compiler.core import defaults


def wall(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass(frozen=True)
class Model:
    name: str
    factory: str
    inputs: tuple[str, ...]
    dims: tuple[str, ...]
    buckets: tuple[int, ...]
    values: dict[str, int]  # the dynamic dims' values the feeds use


def feed_of(engines: Any, model: Model, rows: int, seed: int) -> dict[str, np.ndarray]:
    values = {**engines.spec.opt_values(rows), **model.values}
    feed: dict[str, np.ndarray] = engines.spec.example_feed(rows, seed=seed, values=values)
    # token ids that differ per row (example feeds give zeros, the same for every row), so that each client's
    # answer is its own and a misrouted row shows
    rng = np.random.default_rng(seed)
    for name, array in feed.items():
        if np.issubdtype(array.dtype, np.integer) and "mask" not in name:
            feed[name] = rng.integers(0, 100, size=array.shape).astype(array.dtype)
    return feed


def throughput(engines: Any, feed: dict[str, np.ndarray], rows: int, seconds: float) -> dict[str, float]:
    """``engines(feed)`` back to back for ``seconds``: batches/s, rows/s, mean and p50 batch time."""
    for _ in range(5):
        engines(feed)
    times: list[float] = []
    begin = time.perf_counter()
    while time.perf_counter() - begin < seconds or len(times) < 10:
        start = time.perf_counter()
        engines(feed)
        times.append(time.perf_counter() - start)
    mean = statistics.fmean(times)
    return {"batch_ms_mean": 1e3 * mean, "batch_ms_p50": 1e3 * statistics.median(times), "rows_per_s": rows / mean,
            "calls": len(times)}


class CountingEngines:
    """The engines as the batcher sees them, counting the rows it asks for (more than requested: duplicates), and
    per batch when it was started, how long ``start_parts`` took, when the batcher came to finish it and how long
    that took (``trace``): where a batch's time goes between the batcher's threads and the GPU."""

    def __init__(self, engines: Any) -> None:
        self._engines = engines
        self.buckets, self.input_names, self.output_names = engines.buckets, engines.input_names, engines.output_names
        self.spec = engines.spec
        self.rows = 0
        self.batches = 0
        self.seconds = 0.0
        self.trace: list[tuple[int, float, float, float, float]] = []  # rows, started, started_out, finish, done
        self._lock = threading.Lock()

    def check(self, x: Any) -> Any:
        return self._engines.check(x)

    def reset(self) -> None:
        with self._lock:
            self.rows = self.batches = 0
            self.seconds = 0.0
            self.trace.clear()

    def trace_summary(self) -> dict[str, Any]:
        """Percentiles (50, 99) of each batch's rows, ``start_parts`` (ms: the pack, and the launch where it is the
        caller's), started to the batcher's finish call (ms: the GPU, or the batcher's own delay), and the finish
        (ms: the wait for the GPU and the copy out), and how many batches of each bucket ran in a row (a session
        that alternates buckets pays ONNX Runtime's per-shape setup)."""
        with self._lock:
            trace = list(self.trace)
        if not trace:
            return {}
        rows, started, out, finish, done = (np.asarray(column) for column in zip(*trace, strict=True))
        buckets = [self._engines.bucket_for(int(n)) for n in rows] if hasattr(self._engines, "bucket_for") else []
        changes = sum(a != b for a, b in itertools.pairwise(buckets))

        def pct(values: np.ndarray) -> list[float]:
            return [round(float(np.percentile(values, q)), 3) for q in (50, 99)]

        return {"rows": pct(rows), "start_ms": pct(1e3 * (out - started)), "to_finish_ms": pct(1e3 * (finish - out)),
                "finish_ms": pct(1e3 * (done - finish)), "bucket_changes_per_batch": changes / max(1, len(trace) - 1)}

    def __call__(self, x: Any) -> Any:
        start = time.perf_counter()
        out = self._engines(x)
        self._count(len(next(iter(x.values())) if isinstance(x, dict) else x), start)
        return out

    def __getattr__(self, name: str) -> Any:  # what the batchers ask of the engines (queues_on_gpu, buffer_sets, ...)
        return getattr(self._engines, name)

    def start_parts(self, calls: Any, wait: bool = True, out: Any = None) -> Any:
        start = time.perf_counter()
        finish = self._engines.start_parts(calls, wait=wait, out=out)
        if finish is None:  # no buffer set free
            return None
        started = time.perf_counter()
        rows = sum(c.rows for c in calls)

        def done(read: Any = None) -> Any:
            called = time.perf_counter()
            out = finish() if read is None else finish(read)
            self._count(rows, start)
            with self._lock:
                self.trace.append((rows, start, started, called, time.perf_counter()))
            return out

        from compiler.serve.engines import Started

        return Started(done, getattr(finish, "ready", lambda: True))  # the batchers poll ready() as they would

    def _count(self, rows: int, start: float) -> None:
        with self._lock:
            self.rows += rows
            self.batches += 1
            self.seconds += time.perf_counter() - start


class InstantEngines:
    """The engines' interface answering at once from one stored batch: the batcher's own ceiling on this host
    (its Python per-request cost with these client threads), with no model behind it. It says what the GPU
    engines say (``queues_on_gpu``, ``buffer_sets``, ``starts_at_once``), so the batchers run as they do with
    them, and it answers a batch given results areas (``out``) with views of them, as if the GPU had copied
    the outputs there (the answers' values are not checked in this run)."""

    def __init__(self, engines: Any, outputs: dict[str, np.ndarray]) -> None:
        self._engines = engines
        self.buckets, self.input_names, self.output_names = engines.buckets, engines.input_names, engines.output_names
        self.spec = engines.spec
        self.queues_on_gpu = engines.queues_on_gpu
        self.buffer_sets = engines.buffer_sets
        self.starts_at_once = engines.starts_at_once
        self.contexts = engines.contexts
        self._outputs = outputs

    def check(self, x: Any) -> Any:
        return self._engines.check(x)

    def __call__(self, x: Any) -> Any:
        rows = len(next(iter(x.values())) if isinstance(x, dict) else x)
        return {name: out[:rows] for name, out in self._outputs.items()}

    def start_parts(self, calls: Any, wait: bool = True, out: Any = None) -> Any:
        rows = sum(c.rows for c in calls)
        outputs = {name: a[:rows] for name, a in self._outputs.items()}
        if out is not None:
            outputs = {name: out[name][:a.size].reshape(a.shape) for name, a in outputs.items()}
        return lambda read=None: outputs if read is None else read(outputs)


def batcher_run(engines: Any, model: Model, workers: int, clients: int, requests: int, max_wait_ms: float,
                mode: str = "threads", check_rows: bool = True, client_processes: int | None = None,
                in_flight: int | None = None, cap_s: float | None = None,
                switch_interval: float | None = defaults.SWITCH_INTERVAL_S) -> dict[str, Any]:
    """``clients`` callers of single-row requests, each sending its next when answered, until ``requests``
    are answered (or ``cap_s`` seconds have passed: no client sends after that, so that a collapsed configuration
    costs the run no more than that). ``mode``: "threads" (a thread per client blocking in ``submit``), "asyncio" (one
    event loop, a coroutine per client awaiting ``infer``, as an asyncio server's handlers would) or
    "processes" (a ``ProcessBatcher`` and client threads in ``client_processes`` other processes, as a
    server with several worker processes would), "processes-asyncio" (the same with coroutines). ``switch_interval``:
    ``DynamicBatcher``'s (None: the interpreter's as it is)."""
    from compiler.serve.batcher import DynamicBatcher

    pool = feed_of(engines, model, clients, seed=7)
    reference = engines(pool)
    reference = reference if isinstance(reference, dict) else {engines.output_names[0]: reference}
    counting = CountingEngines(engines)
    requests_of = [{n: a[i:i + 1] for n, a in pool.items()} for i in range(clients)]
    inputs_of = [r if len(r) > 1 else next(iter(r.values())) for r in requests_of]
    names = engines.output_names
    processes = steady = None
    steady_ms = np.zeros(0)  # the process modes: the latencies of the answers the steady rate counts
    process_stats: dict[str, float] = {}  # the process modes': batches each way, and where the CPU went
    if mode.startswith("processes"):
        from compiler.serve.processes import ProcessBatcher

        if in_flight is not None:
            in_flight = min(in_flight, engines.buffer_sets)
        with ProcessBatcher(counting, capacity=clients, max_wait_ms=max_wait_ms, timeout=30.0,
                            in_flight=in_flight) as process_batcher:
            in_flight = process_batcher.in_flight
            counting.reset()  # the batcher's probe of the output sizes is no request
            batcher_cpu = process_batcher.cpu_seconds
            server_cpu = time.process_time()
            ran = process_clients.run(process_batcher, inputs_of, requests,
                                      client_processes or process_clients.default_processes(clients),
                                      kind="asyncio" if mode == "processes-asyncio" else "threads", seconds=cap_s)
            server_cpu = time.process_time() - server_cpu
            batcher_cpu = process_batcher.cpu_seconds - batcher_cpu
        seconds, latencies, answers, lost = ran["seconds"], ran["latencies"].tolist(), ran["answers"], ran["lost"]
        processes, steady = ran["processes"], ran["steady_requests_per_s"]
        steady_ms = np.asarray(ran["steady_latencies"]) * 1e3  # empty exactly when ``steady`` is None
        # batches answered from a page-locked results area (GPU), and through the slots; where the CPU went: the
        # batcher's one thread (busy near 1.0: it is the limit), this whole process (with the CUDA runtime's
        # threads and the spawning), the client processes while they sent (cores)
        process_stats = {"batches_in_areas": process_batcher.batches_in_areas,
                         "batches_in_slots": process_batcher.batches_in_slots,
                         "batcher_thread_busy": batcher_cpu / seconds if seconds else 0.0,
                         "batcher_thread_us_per_request": 1e6 * batcher_cpu / max(1, len(latencies)),
                         "server_cores": server_cpu / seconds if seconds else 0.0,
                         "client_cores": ran["cpu_seconds"] / seconds if seconds else 0.0}
    else:
        batcher = DynamicBatcher(counting, max_wait_ms=max_wait_ms, workers=workers,  # type: ignore[arg-type]
                                 timeout=30.0, switch_interval=switch_interval)
        loop = process_clients.ClosedLoop(requests, time.monotonic() + cap_s if cap_s is not None else float("inf"))
        begin = time.perf_counter()
        if mode == "asyncio":
            loop.in_asyncio(lambda x: batcher.infer(x, timeout=30.0), inputs_of, list(range(clients)))
        else:
            loop.in_threads(lambda x: batcher.submit(x, timeout=30.0), inputs_of, list(range(clients)))
        seconds = time.perf_counter() - begin
        batcher.close()
        latencies, answers, lost = loop.latencies, loop.answers, loop.lost
    misrouted = 0
    if check_rows:  # an answer is misrouted when another client's reference row is closer to it than its own
        refs = np.stack([process_clients.first_values(reference[names[0]][i:i + 1]) for i in range(clients)])
        misrouted = sum(int(np.argmin(np.abs(refs - got).max(axis=1)) != index)
                        for index, got in answers)
    whole_ms = np.asarray(latencies) * 1e3
    # the process modes: the latencies of the answers the steady rate counts (those that came within the span; a
    # slow one sent just before its end is left out as a slow one from before its start is kept), so that throughput
    # and p99 describe one span (in the last batches, once a process is done, the rest wait out max_wait for
    # company); the whole run's beside, as are the batch counts and sizes. Clients in this process stop together:
    # their whole run is their steady span.
    ms = steady_ms if len(steady_ms) else whole_ms
    whole = len(latencies) / seconds if seconds else 0.0
    return {"mode": mode, "clients": clients, "client_processes": processes,
            "in_flight": in_flight if mode.startswith("processes") else None,
            "requests": requests,
            "answered": len(latencies), "lost": lost,
            "misrouted": misrouted, "duplicated_rows": max(0, counting.rows - len(latencies) - lost),
            "seconds": seconds,
            # the process modes: while every client process was sending (``process_clients.steady``)
            "requests_per_s": steady if steady is not None else whole, "requests_per_s_whole_run": whole,
            "p50_ms": _percentile(ms, 50), "p99_ms": _percentile(ms, 99),
            "p50_ms_whole_run": _percentile(whole_ms, 50), "p99_ms_whole_run": _percentile(whole_ms, 99),
            "batches": counting.batches, "mean_batch_rows": counting.rows / max(1, counting.batches),
            "mean_batch_ms": 1e3 * counting.seconds / max(1, counting.batches), "trace": counting.trace_summary(),
            **process_stats}


def _percentile(ms: np.ndarray, p: float) -> float | None:
    return float(np.percentile(ms, p)) if len(ms) else None


def in_threads(target: Any, count: int) -> float:
    """``target(i)`` in ``count`` threads at once, i = 0 .. count - 1: seconds until the last one returns."""
    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(count)]
    begin = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - begin


def parts_throughput(engines: Any, feed: dict[str, np.ndarray], rows: int, seconds: float) -> dict[str, float]:
    """``engines.run_parts`` of ``rows`` single-row feeds (a full batch as the batcher hands it over), back to back
    with no clients: the pack into pinned memory against ``throughput``'s one contiguous array."""
    calls = [engines.check({n: a[i:i + 1] for n, a in feed.items()}) for i in range(rows)]
    for _ in range(3):
        engines.run_parts(calls)
    times: list[float] = []
    begin = time.perf_counter()
    while time.perf_counter() - begin < seconds or len(times) < 10:
        start = time.perf_counter()
        engines.run_parts(calls)
        times.append(time.perf_counter() - start)
    mean = statistics.fmean(times)
    return {"batch_ms_mean": 1e3 * mean, "rows_per_s": rows / mean, "calls": len(times)}


def parallel_throughput(engines: Any, feed: Any, rows: int, threads: int, seconds: float) -> dict[str, float]:
    """``threads`` callers of ``engines(feed)`` at once for ``seconds``: rows/s and mean call time (each has its
    own context when ``threads`` <= contexts): what the backend itself does with concurrent calls."""
    calls: list[float] = []
    lock = threading.Lock()
    stop = time.perf_counter() + seconds

    def caller() -> None:
        while time.perf_counter() < stop:
            start = time.perf_counter()
            engines(feed)
            with lock:
                calls.append(time.perf_counter() - start)

    elapsed = in_threads(lambda _: caller(), threads)
    return {"threads": threads, "rows_per_s": rows * len(calls) / elapsed,
            "batch_ms_mean": 1e3 * statistics.fmean(calls) if calls else 0.0}


def postprocess(out: Any) -> Any:
    """A classifier's softmax + top-5, a mean over tokens for an embedding model, or for a segmenter the label of
    every 8th pixel across and down (numpy's full-size label map alone takes longer than the GPU's whole batch):
    numpy, on the host."""
    x = np.asarray(out if not isinstance(out, dict) else next(iter(out.values())), dtype=np.float32)
    if x.ndim == 2:
        z = np.exp(x - x.max(axis=1, keepdims=True))
        z /= z.sum(axis=1, keepdims=True)
        return np.argsort(-z, axis=1)[:, :5]
    if x.ndim == 4:
        return x[:, :, ::8, ::8].argmax(axis=1)
    return x.mean(axis=1)


def paired_walls(first: Any, second: Any, repeat: int) -> tuple[list[float], list[float]]:
    """Seconds of each run of ``first()`` and of ``second()``, run in turns ``repeat`` times each (which one starts a
    turn alternates): a drift of the host's speed (other processes ending, clocks) reaches both alike, as it would
    not if each ran its repeats in a row."""
    times: tuple[list[float], list[float]] = ([], [])
    for turn in range(repeat):
        order = [(first, times[0]), (second, times[1])]
        for fn, kept in order if turn % 2 == 0 else order[::-1]:  # neither always runs first
            start = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - start)
    return times


MAP_RUNS = 5  # runs of map and of the loop each, in turns


def map_run(engines: Any, model: Model, rows: int, count: int) -> dict[str, Any]:
    """``map`` vs the sequential loop, and the stages alone on one context: copy (upload and download, on the GPU),
    compute, post (what ``map``'s thread does per batch once the outputs are in pinned memory: copy them out into
    arrays of the caller's own, and post-process them). The bound is max(copy, compute, post) per batch, with one
    context as with two: each of a context's two buffer sets copies inputs of 1 MiB or more on its own copy stream,
    so a batch's copy overlaps the batch before it. Smaller copies (the transformer's) stay on the context's
    stream. Post counts the copy out of pinned memory: it takes longer than the GPU's whole batch for the
    segmenter (67 MB out per batch of 16) and microseconds for the other two models."""
    batches = [feed_of(engines, model, rows, seed=i) for i in range(4)]
    work = [batches[i % len(batches)] for i in range(count)]
    args = [b if len(b) > 1 else next(iter(b.values())) for b in work]
    for a in args[:3]:
        postprocess(engines(a))

    def sequential() -> None:
        for a in args:
            postprocess(engines(a))

    def mapped() -> None:
        for _ in engines.map(args, postprocess):
            pass

    sequential_runs, map_runs = paired_walls(sequential, mapped, MAP_RUNS)
    sequential_s, map_s = statistics.median(sequential_runs) / count, statistics.median(map_runs) / count
    call = engines.check(args[0])
    bucket = engines.bucket_for(call.rows)
    with engines.borrow() as context:
        context.run(bucket, call, 0, call.rows, True)
        context.wait()

        def copy() -> None:
            context.upload(bucket, call, 0, call.rows)
            context.download(True)
            context.wait()

        def compute() -> None:
            context.compute(bucket, call)
            context.wait() if not context.on_gpu else _sync(context)

        copy_s = wall(copy, 20)
        compute_s = wall(compute, 20)
        context.run(bucket, call, 0, call.rows, True)
        context.wait()
        post_s = wall(lambda: postprocess(context.copy_outputs()), 20)
    bound_s = max(copy_s, compute_s, post_s)
    return {"batches": count, "rows": rows, "copy_ms": 1e3 * copy_s, "compute_ms": 1e3 * compute_s,
            "post_ms": 1e3 * post_s, "bound_ms": 1e3 * bound_s, "map_ms": 1e3 * map_s,
            "sequential_ms": 1e3 * sequential_s, "map_vs_bound": bound_s / map_s if map_s else 0.0,
            "sequential_over_map": sequential_s / map_s if map_s else 0.0,
            "sequential_runs_ms": [round(1e3 * t / count, 4) for t in sequential_runs],
            "map_runs_ms": [round(1e3 * t / count, 4) for t in map_runs]}


def _sync(context: Any) -> None:
    context.stream.synchronize()


