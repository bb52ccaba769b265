"""Does serving reach its bound? ``engines(x)``, ``DynamicBatcher`` and ``engines.map`` per backend and context count.

For a ResNet-50-sized CNN (``examples.models:resnet50_like``, 3x224x224) and the transformer
example (``examples.models:transformer_encoder``, S=128), this builds directories with
``trtc build --engine none`` at FP32 and FP16 (FP16 calibrated on random data: speed only), then
for each backend (onnxruntime at FP32 and FP16, torch on the FP32 source with CUDA graphs,
tensorrt when it imports: its engines are built by ``trtc rebuild``) and for 1 and 2
contexts (batcher workers = contexts):

* ``engines(x)``: end-to-end throughput of host numpy batches at the largest bucket (the bound);
* ``DynamicBatcher`` with closed-loop clients sending single-row requests until ``--requests``
  are answered, in four modes: ``--clients`` threads blocking in ``submit`` (default 64),
  coroutines of one asyncio event loop awaiting ``infer``, and clients in
  ``--client-processes`` other processes sending to a ``ProcessBatcher`` (its default
  ``in_flight``, or ``--in-flight``), as threads (``processes``) or coroutines (``processes-asyncio``); coroutines and
  process clients are two largest buckets (a batch forms while one runs), three when a batch takes
  under 2 ms (the clients' own turnaround is then as long as a batch); in every mode, until a run
  meets both targets, a largest bucket of clients more, up to five (``--no-sweep``: the first count
  only; the run of the highest throughput within the p99 bound counts, every try is in the JSON):
  throughput and p50/p99 latency (for the process modes both while every client process was sending, the
  whole run's beside them), lost (errors, timeouts) and misrouted answers (a row that is not the
  caller's), rows the engines ran beyond the requests (duplicates); targets: throughput >= 80 % of
  the bound, p99 <= max_wait + 2 x the largest bucket's batch time; and once per model the
  batcher's own ceiling in each mode (instant answers, at the first client count);
* with 2 contexts, ``engines(x)`` from 2 threads at once (the backend's own concurrency);
* ``engines.run_parts`` of the largest bucket's rows as single-row feeds, with no clients: what
  packing the requests costs against one contiguous array;
* ``map`` vs the sequential loop ``post(engines(x))`` over ``--map-batches`` batches of
  ``--map-batch`` rows (five runs of each, in turns), and the bound max(copy, compute, post) per
  batch measured stage by stage on one context (copy: to the GPU and back; post: the outputs copied out of
  pinned memory, then post-processed), the issue's bound with one context as with two (a context's
  buffer sets copy inputs of 1 MiB or more on streams of their own; the transformer's small copies stay on
  the context's stream); targets: map >= 90 % of the bound and never slower than the loop.

``--ort-cuda-option KEY=VALUE`` overrides the runtime's ONNX Runtime CUDA options, to compare
(e.g. ``cudnn_conv_algo_search=EXHAUSTIVE``, ONNX Runtime's default); the JSON records whether each
ONNX Runtime context's session computes on the context's own stream; ``--no-cuda-graphs`` loads
every backend without CUDA graphs (the JSON records per run whether a run launched its kernels from
the host, ``launches_on_host``); ``--no-results-areas`` has ``ProcessBatcher`` write every answer into
its slot instead of the GPU copying the outputs into its shared memory (each process run records how
many batches went each way).

``--models segmenter`` measures a per-pixel classifier (``examples.models:segmenter``, 21 classes at
3x224x224) whose outputs are seven times its inputs; with ``--map-only``, ``engines(x)`` and ``map``
only. Copying its outputs out of pinned memory into the caller's arrays takes longer than the GPU's run.

Writes one JSON (``--out``) and prints a table. ``--smoke`` runs tiny sizes on the CPU in seconds
(the test suite runs it). On an H200 (about 5 minutes):

    python benchmarks/serving_gpu.py --out benchmarks/results/serving_gpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import process_clients  # noqa: E402


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


def models_for(smoke: bool, names: Sequence[str] = ()) -> list[Model]:
    """The models ``names`` names; by default the CNN and the transformer (the segmenter, whose
    outputs are seven times its inputs, only when named)."""
    buckets, side, seq = ((1, 4, 8), 16, 16) if smoke else ((1, 16, 64), 224, 128)
    cnn = (Model("cnn", "examples.models:resnet_digits", ("images:Bx1x8x8",), (), buckets, {}) if smoke else
           Model("resnet50", "examples.models:resnet50_like", ("images:Bx3x224x224",), (), buckets, {}))
    known = [cnn,
             Model("transformer", "examples.models:transformer_encoder",
                   ("input_ids:BxS:int64", "attention_mask:BxS:int64"), (f"S=1:{seq}:{seq}",), buckets, {"S": seq}),
             Model("segmenter", "examples.models:segmenter", (f"images:Bx3x{side}x{side}",), (), buckets, {})]
    unknown = set(names) - {m.name for m in known}
    if unknown:
        sys.exit(f"--models {','.join(names)}: no model {', '.join(sorted(unknown))}; choose from "
                 f"{', '.join(m.name for m in known)}")
    return [m for m in known if m.name in names] if names else known[:2]


def build(model: Model, precision: str, root: Path, tensorrt: bool) -> Path:
    """``trtc build --engine none`` (``trtc rebuild`` for engines when TensorRT is here) into root/name-precision."""
    from compiler.cli import cli

    out = root / f"{model.name}-{precision}"
    args = ["build", "--model-factory", model.factory, "--buckets", ",".join(map(str, model.buckets)),
            "--engine", "none", "--out", str(out), "--force", "-q"]
    for spec in model.inputs:
        args += ["--input", spec]
    for dim in model.dims:
        args += ["--dim", dim]
    if precision == "fp16":
        # for speed, not accuracy: random calibration data and a loose gate
        args += ["--fp16", "--calib-data", "random", "--calib-samples", "32", "--min-cosine", "0.5"]
    _trtc(cli, args)
    if tensorrt:
        _trtc(cli, ["rebuild", str(out), "-q"])
    return out


def _trtc(cli: Any, args: list[str]) -> None:
    """One trtc command in this process; its exit code 0 is success, anything else stops the benchmark."""
    try:
        cli.main(args, standalone_mode=False)
    except SystemExit as done:
        if done.code not in (0, None):
            raise


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
    """The engines as the batcher sees them, counting the rows it asks for (more than requested: duplicates)."""

    def __init__(self, engines: Any) -> None:
        self._engines = engines
        self.buckets, self.input_names, self.output_names = engines.buckets, engines.input_names, engines.output_names
        self.spec = engines.spec
        self.rows = 0
        self.batches = 0
        self.seconds = 0.0
        self._lock = threading.Lock()

    def check(self, x: Any) -> Any:
        return self._engines.check(x)

    def reset(self) -> None:
        with self._lock:
            self.rows = self.batches = 0
            self.seconds = 0.0

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
        rows = sum(c.rows for c in calls)

        def done(read: Any = None) -> Any:
            out = finish() if read is None else finish(read)
            self._count(rows, start)
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
                in_flight: int | None = None) -> dict[str, Any]:
    """``clients`` callers of single-row requests, each sending its next when answered, until ``requests``
    are answered. ``mode``: "threads" (a thread per client blocking in ``submit``), "asyncio" (one
    event loop, a coroutine per client awaiting ``infer``, as an asyncio server's handlers would) or
    "processes" (a ``ProcessBatcher`` and client threads in ``client_processes`` other processes, as a
    server with several worker processes would), "processes-asyncio" (the same with coroutines)."""
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
                                      kind="asyncio" if mode == "processes-asyncio" else "threads")
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
                                 timeout=30.0)
        loop = process_clients.ClosedLoop(requests)
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
            "misrouted": misrouted, "duplicated_rows": max(0, counting.rows - requests), "seconds": seconds,
            # the process modes: while every client process was sending (``process_clients.steady``)
            "requests_per_s": steady if steady is not None else whole, "requests_per_s_whole_run": whole,
            "p50_ms": _percentile(ms, 50), "p99_ms": _percentile(ms, 99),
            "p50_ms_whole_run": _percentile(whole_ms, 50), "p99_ms_whole_run": _percentile(whole_ms, 99),
            "batches": counting.batches, "mean_batch_rows": counting.rows / max(1, counting.batches),
            "mean_batch_ms": 1e3 * counting.seconds / max(1, counting.batches), **process_stats}


def _percentile(ms: np.ndarray, p: float) -> float | None:
    return float(np.percentile(ms, p)) if len(ms) else None


def capacity_run(engines: Any, model: Model, workers: int, clients: int, step: int, most: int, requests: int,
                 max_wait_ms: float, mode: str, target: float, p99_bound: float, **options: Any) -> dict[str, Any]:
    """``batcher_run`` with ``clients``, then ``step`` more at a time until a run meets both targets (throughput and
    p99), up to ``most``: closed-loop clients measure ``clients / latency`` (Little's law), so too few leave a batcher
    idle that has room for more (64 clients of a bucket of 64 wait for each other: the next batch fills only once
    the last is answered), and more can lower the p99 as well as raise it. Returns the run of the highest
    throughput within the p99 bound (else the first), with every try's clients, throughput, p99 and failures under
    ``tries``: the capacity at the latency target, as a load generator that sweeps its concurrency measures it."""
    runs = []
    while True:
        run = batcher_run(engines, model, workers, clients, requests, max_wait_ms, mode=mode, **options)
        runs.append(run)
        if (run["requests_per_s"] >= target and within_p99(run, p99_bound)) or clients + step > most:
            break
        clients += step
    fits = [r for r in runs if within_p99(r, p99_bound)]
    best = max(fits, key=lambda r: r["requests_per_s"]) if fits else runs[0]
    best["tries"] = [{k: r.get(k, 0) for k in ("clients", "requests_per_s", "p99_ms", "lost", "misrouted",
                                                "duplicated_rows")} for r in runs]
    return best


def within_p99(run: dict[str, Any], p99_bound: float) -> bool:
    return run["p99_ms"] is not None and run["p99_ms"] <= p99_bound


def sweep_limits(counts: dict[str, tuple[int, int]], largest: int, sweep: bool) -> dict[str, int]:
    """The most clients ``capacity_run`` tries per mode: five largest buckets in every mode, threads included (or the
    first count where there is no sweep)."""
    return {mode: max(count, 5 * largest) if sweep else count for mode, (count, _) in counts.items()}


def batcher_targets(mode: str, batched: dict[str, Any], target: float, p99_bound: float) -> dict[str, bool]:
    """A mode's targets: the throughput and p99 of the run that counts, and nothing lost, misrouted or duplicated in
    any of its tries."""
    return {f"batcher_{mode}_throughput": batched["requests_per_s"] >= target,
            f"batcher_{mode}_p99": within_p99(batched, p99_bound),
            f"batcher_{mode}_nothing_lost": all(t["lost"] == 0 and t["misrouted"] == 0 and t["duplicated_rows"] == 0
                                                for t in batched["tries"])}


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


def paired_walls(first: Any, second: Any, repeat: int) -> tuple[float, float]:
    """Median seconds of ``first()`` and of ``second()``, run in turns ``repeat`` times each (which one starts a turn
    alternates): a drift of the host's speed (other processes ending, clocks) reaches both alike, as it would not if
    each ran its repeats in a row."""
    times: tuple[list[float], list[float]] = ([], [])
    for turn in range(repeat):
        order = [(first, times[0]), (second, times[1])]
        for fn, kept in order if turn % 2 == 0 else order[::-1]:  # neither always runs first
            start = time.perf_counter()
            fn()
            kept.append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


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

    sequential_s, map_s = (seconds / count for seconds in paired_walls(sequential, mapped, 5))
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
            "sequential_over_map": sequential_s / map_s if map_s else 0.0}


_SHORT = {"map_vs_bound": "map", "map_not_slower_than_loop": "map<loop", "batcher_threads_throughput": "thr",
          "batcher_threads_p99": "thr-p99", "batcher_threads_nothing_lost": "thr-lost",
          "batcher_asyncio_throughput": "aio", "batcher_asyncio_p99": "aio-p99",
          "batcher_asyncio_nothing_lost": "aio-lost", "batcher_processes_throughput": "proc",
          "batcher_processes_p99": "proc-p99", "batcher_processes_nothing_lost": "proc-lost",
          "batcher_processes-asyncio_throughput": "paio", "batcher_processes-asyncio_p99": "paio-p99",
          "batcher_processes-asyncio_nothing_lost": "paio-lost"}  # the table's names for missed targets
MODES = ("threads", "asyncio", "processes", "processes-asyncio")


def _sync(context: Any) -> None:
    context.stream.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="The JSON to write.")
    parser.add_argument("--work", type=Path, default=Path("build/serving-gpu"), help="Build directories go here.")
    parser.add_argument("--smoke", action="store_true", help="Tiny models and counts, on the CPU: seconds.")
    parser.add_argument("--backends", default="", help="onnxruntime,torch,tensorrt (default: those that run here).")
    parser.add_argument("--models", default="",
                        help="Which models, by name: resnet50, transformer, segmenter (default: the first two; "
                             "with --smoke the names are cnn, transformer, segmenter).")
    parser.add_argument("--map-only", action="store_true",
                        help="Measure engines(x) (and run_parts) and map only: no batcher modes, no batcher ceilings, "
                             "no calls from two threads at once.")
    parser.add_argument("--ort-cuda-option", action="append", default=[], metavar="KEY=VALUE",
                        help="An ONNX Runtime CUDA provider option over the runtime's (repeatable), to compare, e.g. "
                             "cudnn_conv_algo_search=EXHAUSTIVE.")
    parser.add_argument("--clients", type=int,
                        help="Batcher client threads in this process: the first count (default 64; 8 with --smoke).")
    parser.add_argument("--async-clients", type=int,
                        help="Coroutines awaiting batcher.infer, and process clients: the first count (default: two "
                             "largest buckets, three when a batch takes under 2 ms; 8 with --smoke).")
    parser.add_argument("--modes", default=",".join(MODES),
                        help="Batcher client modes: threads (DynamicBatcher.submit), asyncio (DynamicBatcher.infer), "
                             "processes (ProcessBatcher with client threads in other processes), processes-asyncio "
                             "(the same with coroutines awaiting BatcherClient.infer). Default: all four.")
    parser.add_argument("--client-processes", type=int,
                        help="Client processes in processes mode (default: the cores less 4, at least 2).")
    parser.add_argument("--requests", type=int, help="Batcher requests per run (default 4000 with threads, 20000 "
                        "with asyncio; 200 with --smoke).")
    parser.add_argument("--ort-ordered", action="store_true",
                        help="ONNX Runtime CUDA contexts run one after the other on the GPU instead of side by side "
                             "(compiler.backends.onnxrt.ORDER_RUNS = True), to compare.")
    parser.add_argument("--no-results-areas", action="store_true",
                        help="ProcessBatcher writes every answer into its slot instead of the GPU copying the outputs "
                             "into results areas (compiler.serve.processes.server.RESULTS_AREAS = False), to compare.")
    parser.add_argument("--no-cuda-graphs", action="store_true",
                        help="Load every backend with cuda_graphs=False (to compare: ONNX Runtime launches every "
                             "kernel from the host then).")
    parser.add_argument("--in-flight", type=int,
                        help="ProcessBatcher's in_flight (batches queued at once), at most the engines' buffer sets "
                             "(default: the batcher's own).")
    parser.add_argument("--no-sweep", action="store_true",
                        help="Run every mode with its first client count only, instead of adding a largest bucket of "
                             "clients at a time until a run meets both targets (up to five largest buckets).")
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="The batcher's window (default 5).")
    parser.add_argument("--seconds", type=float, help="Seconds per engines(x) throughput (default 2; 0.2 smoke).")
    parser.add_argument("--map-batches", type=int, help="Batches per map run (default 200; 8 with --smoke).")
    parser.add_argument("--map-batch", type=int, help="Rows per map batch (default 16; 4 with --smoke).")
    parser.add_argument("--switch-interval-ms", type=float,
                        help="Python's GIL switch interval for this run (sys.setswitchinterval; default 5): how long "
                             "a thread waiting for the GIL (a batcher worker back from the GPU) may wait for the "
                             "threads that hold it.")
    args = parser.parse_args()
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1000)
    if args.no_results_areas:
        import compiler.serve.processes.server

        compiler.serve.processes.server.RESULTS_AREAS = False
    if args.ort_ordered:
        import compiler.backends.onnxrt

        compiler.backends.onnxrt.ORDER_RUNS = True

    import torch
    from rich.console import Console
    from rich.table import Table

    from compiler.core.capabilities import tensorrt_version
    from compiler.serve.load import load

    smoke = args.smoke
    wanted_modes = [m for m in args.modes.split(",") if m]
    if not set(wanted_modes) <= set(MODES) or not wanted_modes:
        sys.exit(f"--modes {args.modes}: choose from {','.join(MODES)}")
    cuda = torch.cuda.is_available()
    if not cuda and not smoke:
        sys.exit("serving_gpu needs a CUDA GPU (torch.cuda.is_available() is False); --smoke runs on the CPU")
    device = "cpu" if smoke and not cuda else None
    clients = args.clients or (8 if smoke else 64)
    thread_requests = args.requests or (200 if smoke else 4000)
    async_requests = args.requests or (200 if smoke else 20000)
    seconds = args.seconds if args.seconds is not None else (0.2 if smoke else 2.0)
    map_batches = args.map_batches or (8 if smoke else 200)
    map_batch = args.map_batch or (4 if smoke else 16)
    trt = tensorrt_version() is not None and cuda
    ort_options = dict(o.split("=", 1) for o in args.ort_cuda_option)
    wanted = [b for b in args.backends.split(",") if b] or ["onnxruntime", "torch", *(["tensorrt"] if trt else [])]
    console = Console(width=None if sys.stdout.isatty() else 160)
    started = time.perf_counter()
    runs: list[dict[str, Any]] = []
    ceilings: dict[str, dict[str, Any]] = {}
    if args.map_only:
        wanted_modes = []
    for model in models_for(smoke, [m for m in args.models.split(",") if m]):
        dirs = {p: build(model, p, args.work, trt and "tensorrt" in wanted) for p in ("fp32", "fp16")}
        configs = [(b, p) for b in wanted for p in (("fp32",) if b == "torch" else ("fp32", "fp16"))]
        for backend, precision in configs:
            for contexts in (1, 2):
                engines = load(dirs[precision], backend=backend, contexts=contexts, device=device,
                               ort_cuda_options=ort_options or None, cuda_graphs=not args.no_cuda_graphs)
                on_own_stream = [getattr(c, "_on_our_stream", None) for c in engines._contexts]
                launches_on_host = engines.launches_on_host  # False where every run is a CUDA graph's replay
                starts_at_once = engines.starts_at_once
                largest = engines.buckets[-1]
                one = feed_of(engines, model, largest, seed=1)
                bound = throughput(engines, one if len(one) > 1 else next(iter(one.values())), largest, seconds)
                parts = parts_throughput(engines, one, largest, seconds)
                parallel = parallel_throughput(engines, one if len(one) > 1 else next(iter(one.values())), largest,
                                               contexts, seconds) if contexts > 1 and wanted_modes else None
                # coroutines and clients in other processes: two batches (one runs while the next waits behind it:
                # the batchers keep two in flight on a GPU), and one batch more when a batch takes under 2 ms, where
                # the clients' own turnaround (woken, answer copied out, next request sent: 0.5-1 ms on the H200
                # host under this load) is as long as a batch. At the bound more clients only wait longer (Little's
                # law: latency = clients / throughput), so ``capacity_run`` adds them only until a run meets both
                # targets.
                short = not smoke and bound["batch_ms_mean"] < 2.0
                many = args.async_clients or (8 if smoke else largest * (3 if short else 2))
                counts = {"threads": (clients, thread_requests), "asyncio": (many, async_requests),
                          "processes": (many, async_requests), "processes-asyncio": (many, async_requests)}
                p99_bound = args.max_wait_ms + 2 * bound["batch_ms_mean"]
                target = 0.8 * bound["rows_per_s"]
                most = sweep_limits(counts, largest, sweep=not (args.no_sweep or smoke))
                modes = {mode: capacity_run(engines, model, contexts, counts[mode][0], largest, most[mode],
                                            counts[mode][1], args.max_wait_ms, mode, target, p99_bound,
                                            client_processes=args.client_processes, in_flight=args.in_flight)
                         for mode in wanted_modes}
                mapped = map_run(engines, model, map_batch, map_batches)
                if model.name not in ceilings and wanted_modes:  # once per model: the batcher, instant answers
                    ready = engines(one)
                    ready = ready if isinstance(ready, dict) else {engines.output_names[0]: ready}
                    instant = InstantEngines(engines, {n: np.asarray(a) for n, a in ready.items()})
                    ceilings[model.name] = {}
                    for mode in wanted_modes:
                        many, count = counts[mode]
                        run = batcher_run(instant, model, 1, many, count, args.max_wait_ms, mode=mode,
                                          check_rows=False, client_processes=args.client_processes,
                                          in_flight=args.in_flight)
                        ceilings[model.name][mode] = {k: run[k] for k in (
                            "clients", "requests_per_s", "p50_ms", "p99_ms", "mean_batch_rows", "client_processes",
                            "batcher_thread_busy", "batcher_thread_us_per_request", "server_cores", "client_cores")
                            if k in run}
                        console.print(f"{model.name}: the batcher's own ceiling here (instant answers, {many} {mode} "
                                      f"clients) {run['requests_per_s']:,.0f} req/s"
                                      + (f", batcher thread {run['batcher_thread_busy']:.0%} busy, clients "
                                         f"{run['client_cores']:.1f} cores" if "client_cores" in run else ""))
                engines.close()
                targets = {"map_vs_bound": mapped["map_vs_bound"] >= 0.9,
                           "map_not_slower_than_loop": mapped["sequential_over_map"] >= 1.0}
                for mode, batched in modes.items():
                    batched["p99_bound_ms"] = p99_bound
                    batched["throughput_target"] = target
                    targets.update(batcher_targets(mode, batched, target, p99_bound))
                runs.append({"model": model.name, "backend": backend, "precision": precision, "contexts": contexts,
                             "workers": contexts, "device": engines.device, "bound": bound,
                             "parallel_calls": parallel, "run_parts": parts,
                             "ort_session_on_context_stream": on_own_stream if backend == "onnxruntime" else None,
                             "ort_runs_ordered": args.ort_ordered if backend == "onnxruntime" else None,
                             "buffer_sets": engines.buffer_sets,
                             "launches_on_host": launches_on_host,
                             "starts_at_once": starts_at_once,  # DynamicBatcher keeps two in flight where True
                             **{("batcher" if mode == "threads" else f"batcher_{mode}"): result
                                for mode, result in modes.items()},
                             "map": mapped, "targets": targets})
                console.print(f"{model.name} {backend}/{precision} contexts={contexts}: "
                              f"bound {bound['rows_per_s']:,.0f} rows/s ({bound['batch_ms_mean']:.2f} ms), "
                              f"run_parts {parts['batch_ms_mean']:.2f} ms"
                              + (f", {contexts} callers {parallel['rows_per_s']:,.0f} rows/s "
                                 f"({parallel['batch_ms_mean']:.2f} ms)" if parallel else "")
                              + "".join(f"; {mode} {b['requests_per_s']:,.0f} req/s p99 {b['p99_ms']:.1f} ms "
                                        f"batch {b['mean_batch_rows']:.0f} rows {b['mean_batch_ms']:.1f} ms"
                                        + (f" batcher thread {b['batcher_thread_busy']:.0%} busy "
                                           f"({b['batcher_thread_us_per_request']:.1f} us/req), clients "
                                           f"{b['client_cores']:.1f} cores" if "client_cores" in b else "")
                                        for mode, b in modes.items())
                              + f"; map/bound {mapped['map_vs_bound']:.2f}, "
                                f"map/loop {mapped['sequential_over_map']:.2f}"
                              )
    short = {"threads": "threads", "asyncio": "asyncio", "processes": "procs", "processes-asyncio": "procs-aio"}
    table = Table("model", "backend", "ctx", "bound rows/s",
                  *[h for mode in wanted_modes for h in (f"{short[mode]} req/s", "p99 ms")], "(p99 bound)", "lost",
                  "map ms", "loop ms", "bound ms", "missed",
                  title=f"serving at its bound ({'smoke, ' if smoke else ''}max_wait {args.max_wait_ms:g} ms, "
                        f"client threads from {clients})")
    for r in runs:
        m = r["map"]
        batched = [r["batcher" if mode == "threads" else f"batcher_{mode}"] for mode in wanted_modes]
        missed = [_SHORT.get(k, k) for k, ok in r["targets"].items() if not ok]
        table.add_row(r["model"], f"{r['backend']}/{r['precision']}", str(r["contexts"]),
                      f"{r['bound']['rows_per_s']:,.0f}",
                      *[t for b in batched for t in (f"{b['requests_per_s']:,.0f}", f"{b['p99_ms']:.1f}")],
                      f"{batched[0]['p99_bound_ms']:.1f}" if batched else "-",
                      str(sum(b["lost"] + b["misrouted"] for b in batched)) if batched else "-",
                      f"{m['map_ms']:.2f}", f"{m['sequential_ms']:.2f}", f"{m['bound_ms']:.2f}",
                      ", ".join(missed) or "none")
    console.print(table)
    machine = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(0) if cuda else None}
    import onnxruntime

    machine["onnxruntime"] = onnxruntime.__version__
    report = {"kind": "trtc-serving-bench", "smoke": smoke, "command": " ".join(sys.argv), "machine": machine,
              "settings": {"clients": clients, "async_clients": args.async_clients, "thread_requests": thread_requests,
                           "async_requests": async_requests, "ort_runs_ordered": args.ort_ordered,
                           "modes": wanted_modes, "client_processes": args.client_processes,
                           "in_flight": args.in_flight, "sweep": not args.no_sweep,
                           "max_wait_ms": args.max_wait_ms, "map_only": args.map_only,
                           "seconds": seconds, "map_batches": map_batches, "map_batch": map_batch,
                           "backends": wanted, "ort_cuda_options": ort_options,
                           "cuda_graphs": not args.no_cuda_graphs, "results_areas": not args.no_results_areas,
                           "switch_interval_ms": sys.getswitchinterval() * 1000},
              "seconds": round(time.perf_counter() - started, 1), "runs": runs, "batcher_ceiling": ceilings,
              "all_targets_met": all(all(r["targets"].values()) for r in runs)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {args.out} in {report['seconds']:.0f} s")


if __name__ == "__main__":
    main()
