"""Where a request's time goes in ``ProcessBatcher``: a timeline of every batch, on a GPU.

Runs ``serving_measure.batcher_run`` in a process mode (client processes sending single-row requests)
with the batcher's methods wrapped to note when each batch was taken, started, finished and its
callers woken, and when each client sent its next request after being woken. Per run it prints
and writes percentiles (ms) of:

* ``wait_before_start``: from a request's submission to its batch's start (the batch forming, and a
  full batch waiting for a free buffer set);
* ``start``: the batcher's thread starting the batch (gather, pack, copies and launch queued);
* ``start_to_finish``: from the start to the batcher's call to finish it (the GPU, and the batch
  queued behind the one before);
* ``finish``: that call (its wait for the GPU, and the answers pointed at);
* ``finish_to_wake``: from the finish to the write that wakes the batch's client processes;
* ``client_turnaround``: from that write to the next request on the same slot (the client process
  woke the caller, who read the answer and sent again; a slot goes back to its process's free slots,
  so with threads interleaving the next request may be another thread's);
* ``launch``: where a context queues its runs on a thread of its own (ONNX Runtime without CUDA
  graphs), each run there, with the thread's busy fraction.

The wrapping costs a few microseconds per batch; the throughput is a little below
``serving_gpu.py``'s. ``--runs`` takes backend:precision:contexts:mode:clients items, e.g.
``torch:fp32:1:processes:192`` (the transformer example, S=128, as in ``serving_gpu.py``).

    python benchmarks/process_batcher_trace.py --out build/trace.json --runs torch:fp32:1:processes:192
"""

from __future__ import annotations

import argparse
import bisect
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import serving_gpu, serving_measure  # noqa: E402

_batches: list[dict[str, Any]] = []
_wakes: list[tuple[float, list[int]]] = []
_launches: list[tuple[int, float, float]] = []  # (the launcher's id, begin, end)


def _wrap() -> None:
    """Note the batcher's batches, wakes and launcher runs (``_batches``, ``_wakes``, ``_launches``)."""
    from compiler.backends.onnxrt import OrtCudaContext
    from compiler.serve.engines import Started
    from compiler.serve.processes import ProcessBatcher

    start, wake, queue = ProcessBatcher._start, ProcessBatcher._wake, OrtCudaContext._queue_parts

    def traced_start(self: Any, batch: Any, wait: bool) -> Any:
        begin = time.monotonic()
        started = start(self, batch, wait)
        if started is None:
            return None
        note = {"begin": begin, "started": time.monotonic(), "slots": batch.slots.tolist(),
                "submitted": batch.submitted.tolist()}
        _batches.append(note)
        batch_, finish, area = started

        def traced_finish(*read: Any) -> Any:
            note["finish"] = time.monotonic()
            try:
                return finish(*read)
            finally:
                note["finished"] = time.monotonic()

        return batch_, Started(traced_finish, finish.ready), area  # type: ignore[attr-defined]

    def traced_wake(self: Any, slots: np.ndarray) -> None:
        _wakes.append((time.monotonic(), np.asarray(slots).tolist()))
        wake(self, slots)

    def traced_queue(self: Any, *args: Any) -> None:
        begin = time.monotonic()
        try:
            queue(self, *args)
        finally:
            _launches.append((id(self._launcher), begin, time.monotonic()))

    ProcessBatcher._start = traced_start  # type: ignore[method-assign]
    ProcessBatcher._wake = traced_wake  # type: ignore[method-assign]
    OrtCudaContext._queue_parts = traced_queue  # type: ignore[method-assign,assignment]


def percentiles(seconds: list[float]) -> dict[str, float] | None:
    if not seconds:
        return None
    ms = np.asarray(seconds) * 1e3
    return {f"p{p}": round(float(np.percentile(ms, p)), 3) for p in (50, 90, 99)}


def timeline(batches: list[dict[str, Any]], wakes: list[tuple[float, list[int]]],
             launches: list[tuple[int, float, float]]) -> dict[str, Any]:
    """The percentiles of the module docstring from the notes of one run."""
    done = [b for b in batches if "finished" in b]
    if not done:
        return {}
    woken: dict[int, list[float]] = {}  # slot -> when its answers' wakes were written
    for at, slots in wakes:
        for slot in slots:
            woken.setdefault(slot, []).append(at)
    sent: dict[int, list[float]] = {}  # slot -> when its requests were submitted
    for b in done:
        for slot, submitted in zip(b["slots"], b["submitted"], strict=True):
            sent.setdefault(slot, []).append(submitted)
    turnaround = []
    for slot, times in woken.items():
        later = sorted(sent.get(slot, []))
        for at in times:  # the slot's first request sent after the wake
            i = bisect.bisect_right(later, at)
            if i < len(later):
                turnaround.append(later[i] - at)

    def first_wake(b: dict[str, Any]) -> float | None:
        return next((at for at in woken.get(b["slots"][0], []) if at >= b["finished"]), None)

    span = done[-1]["finished"] - done[0]["begin"]
    report: dict[str, Any] = {
        "batches": len(done), "requests": sum(len(b["slots"]) for b in done),
        "requests_per_s": sum(len(b["slots"]) for b in done) / span if span > 0 else None,
        "wait_before_start": percentiles([b["begin"] - s for b in done for s in b["submitted"]]),
        "start": percentiles([b["started"] - b["begin"] for b in done]),
        "start_to_finish": percentiles([b["finish"] - b["started"] for b in done]),
        "finish": percentiles([b["finished"] - b["finish"] for b in done]),
        "finish_to_wake": percentiles([woke - b["finished"] for b in done if (woke := first_wake(b)) is not None]),
        "client_turnaround": percentiles(turnaround)}
    by_launcher: dict[int, list[tuple[float, float]]] = {}
    for launcher, begin, end in launches:
        by_launcher.setdefault(launcher, []).append((begin, end))
    report["launchers"] = [{"runs": len(runs), "busy": round(sum(e - b for b, e in runs) / span, 3),
                            "run": percentiles([e - b for b, e in runs])} for runs in by_launcher.values()]
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="The JSON to write.")
    parser.add_argument("--runs", nargs="+", required=True,
                        help="backend:precision:contexts:mode:clients, e.g. onnxruntime:fp16:2:processes-asyncio:192.")
    parser.add_argument("--requests", type=int, help="Requests per run (default 20000; 400 with --smoke).")
    parser.add_argument("--work", type=Path, default=Path("build/serving-trace"), help="Where the builds go.")
    parser.add_argument("--smoke", action="store_true", help="The small transformer on the CPU, in seconds (tests).")
    args = parser.parse_args()

    from compiler.serve.load import load

    _wrap()
    model = serving_gpu.models_for(args.smoke, ["transformer"])[0][0]
    largest = max(model.buckets)
    requests = args.requests or (400 if args.smoke else 20000)
    builds: dict[str, Path] = {}
    runs = []
    for item in args.runs:
        backend, precision, contexts, mode, clients = item.split(":")
        if precision not in builds:
            builds[precision] = serving_gpu.build(model, precision, args.work, tensorrt=False)
        with load(builds[precision], backend=backend, contexts=int(contexts),
                  device="cpu" if args.smoke else None) as engines:
            feed = serving_measure.feed_of(engines, model, largest, seed=1)
            bound = serving_measure.throughput(engines, feed, largest, 0.2 if args.smoke else 1.0)
            _batches.clear()
            _wakes.clear()
            _launches.clear()
            run = serving_measure.batcher_run(engines, model, int(contexts), int(clients), requests, 5.0, mode=mode)
        trace = timeline(list(_batches), list(_wakes), list(_launches))
        runs.append({"run": item, "bound_rows_per_s": bound["rows_per_s"],
                     "requests_per_s": run["requests_per_s"], "p99_ms": run["p99_ms"],
                     "batcher_thread_busy": run.get("batcher_thread_busy"), "timeline": trace})
        p99 = "-" if run["p99_ms"] is None else f"{run['p99_ms']:.2f} ms"  # None: nothing answered
        print(f"{item}: bound {bound['rows_per_s']:,.0f} rows/s, {run['requests_per_s']:,.0f} req/s, "
              f"p99 {p99}, batcher thread {run.get('batcher_thread_busy', 0):.0%} busy")
        for what, value in trace.items():
            print(f"  {what}: {value}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"kind": "trtc-process-batcher-trace", "smoke": args.smoke,
                                    "command": " ".join(sys.argv), "runs": runs}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
