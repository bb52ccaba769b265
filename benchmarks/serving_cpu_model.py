"""The serving paths on a CPU model of the GPU (``benchmarks/gpu_model.py``): where the batchers and ``map`` lose
time to their own threads, waits and hand-offs, without a GPU.

For each modelled backend (``ort``: ONNX Runtime without CUDA graphs, its runs handed to a launcher thread per
context; ``graphs``: CUDA graph replays, as torch, TensorRT and ONNX Runtime with graphs; ``ort-shape``: ``ort``
whose kernels set up again (``--shape-change-ms``) whenever a session runs another bucket than its last, as ONNX
Runtime's fused convolution without a bias reallocates its zero bias per input shape) and 1 and 2 contexts
(batcher workers = contexts, as ``serving_gpu.py``):

* the bound: ``engines(x)`` at the largest bucket;
* ``DynamicBatcher`` with ``--clients`` threads blocking in ``submit`` and ``--coroutines`` coroutines awaiting
  ``infer``, single-row requests (``serving_measure.batcher_run``): throughput, p50/p99, rows per batch, and the
  batcher's looks at running batches per batch (``ready()`` calls: a worker that polls looks many times);
* ``map`` against the plain loop over ``--map-batches`` batches of 16 (five runs of each, in turns);
* once, the batcher's ceiling with instant answers in each client mode.

Every figure is the median of ``--repeats`` runs (a shared 2-core machine is noisy). Writes one JSON (``--out``)
and prints a table; about two minutes on 2 cores:

    python benchmarks/serving_cpu_model.py --out /tmp/serving_cpu_model.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import serving_measure  # noqa: E402
from benchmarks.gpu_model import Timing, model_engines  # noqa: E402

KINDS = ("ort", "graphs", "ort-shape")
ROW = (3, 32, 32)
MODEL = serving_measure.Model("model", "", ("images:Bx3x32x32",), (), (1, 16, 64), {})


def timing_of(kind: str, shape_change_ms: float) -> Timing:
    if kind == "graphs":
        return Timing.resnet50_graphs()
    timing = Timing.resnet50_ort()
    return dataclasses.replace(timing, shape_change_ms=shape_change_ms) if kind == "ort-shape" else timing


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput, with every run's throughput and p99 beside it."""
    ordered = sorted(runs, key=lambda r: r["requests_per_s"])
    best = dict(ordered[len(ordered) // 2])
    best["runs"] = [{"requests_per_s": round(r["requests_per_s"]), "p99_ms": r["p99_ms"]} for r in runs]
    return best


def batcher_figures(engines: Any, contexts: int, mode: str, clients: int, requests: int, max_wait_ms: float,
                    repeats: int) -> dict[str, Any]:
    backend = engines._backend
    runs = []
    for _ in range(repeats):
        backend.looks = 0
        backend.late.clear()
        run = serving_measure.batcher_run(engines, MODEL, contexts, clients, requests, max_wait_ms, mode=mode)
        run["looks_per_batch"] = backend.looks / max(1, run["batches"])
        run["waited_after_done_ms_p50"] = 1e3 * statistics.median(backend.late) if backend.late else 0.0
        runs.append({k: run[k] for k in ("requests_per_s", "p50_ms", "p99_ms", "mean_batch_rows", "batches", "lost",
                                         "misrouted", "duplicated_rows", "looks_per_batch",
                                         "waited_after_done_ms_p50")})
    return median_run(runs)


def ceilings(mode_counts: dict[str, tuple[int, int]], max_wait_ms: float, repeats: int) -> dict[str, Any]:
    """The batcher with instant answers (``serving_measure.InstantEngines``) in each mode: its own ceiling here."""
    engines = model_engines(Timing.resnet50_graphs(), 1, MODEL.buckets, ROW)
    one = serving_measure.feed_of(engines, MODEL, MODEL.buckets[-1], seed=1)["images"]
    instant = serving_measure.InstantEngines(engines, {"logits": np.asarray(engines(one))})
    out = {}
    for mode, (clients, requests) in mode_counts.items():
        runs = [serving_measure.batcher_run(instant, MODEL, 1, clients, requests, max_wait_ms, mode=mode,
                                        check_rows=False) for _ in range(repeats)]
        out[mode] = {k: median_run(runs)[k] for k in ("requests_per_s", "p50_ms", "p99_ms", "runs")}
    engines.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="The JSON to write.")
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"Modelled backends ({', '.join(KINDS)}).")
    parser.add_argument("--contexts", default="1,2", help="Context counts (default 1,2).")
    parser.add_argument("--clients", type=int, default=64, help="Client threads (default 64).")
    parser.add_argument("--coroutines", type=int, default=192, help="Coroutines awaiting infer (default 192).")
    parser.add_argument("--requests", type=int, default=2000, help="Requests per thread run (asyncio: three times).")
    parser.add_argument("--map-batches", type=int, default=60, help="Batches per map run (default 60).")
    parser.add_argument("--repeats", type=int, default=3, help="Runs per figure; the median counts (default 3).")
    parser.add_argument("--shape-change-ms", type=float, default=50.0,
                        help="ort-shape: the run's extra launch time at each new bucket of a session (default 50).")
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="The batcher's window (default 5).")
    parser.add_argument("--largest-only", action="store_true",
                        help="Serve every batch at the largest bucket (what ONNX Runtime on CUDA does for a model "
                             "whose kernels keep per-shape state: ort-shape then never changes shape).")
    parser.add_argument("--no-map", action="store_true", help="Skip map.")
    parser.add_argument("--no-ceiling", action="store_true", help="Skip the instant-answer ceilings.")
    args = parser.parse_args()
    counts = {"threads": (args.clients, args.requests), "asyncio": (args.coroutines, 3 * args.requests)}
    started = time.perf_counter()
    runs = []
    for kind in [k for k in args.kinds.split(",") if k]:
        for contexts in [int(c) for c in args.contexts.split(",") if c]:
            buckets = MODEL.buckets[-1:] if args.largest_only else MODEL.buckets
            engines = model_engines(timing_of(kind, args.shape_change_ms), contexts, buckets, ROW)
            one = serving_measure.feed_of(engines, MODEL, MODEL.buckets[-1], seed=1)["images"]
            bound = serving_measure.throughput(engines, one, MODEL.buckets[-1], 1.0)
            run: dict[str, Any] = {"kind": kind, "contexts": contexts, "bound_rows_per_s": bound["rows_per_s"],
                                   "bound_batch_ms": bound["batch_ms_mean"]}
            for mode, (clients, requests) in counts.items():
                run[mode] = batcher_figures(engines, contexts, mode, clients, requests, args.max_wait_ms,
                                            args.repeats)
            if not args.no_map:
                run["map"] = map_figures(engines, args.map_batches)
            engines.close()
            runs.append(run)
            print(summary(run), flush=True)
    report = {"kind": "trtc-serving-cpu-model", "command": " ".join(sys.argv),
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "cores": os.cpu_count()},
              "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "timings": {kind: dataclasses.asdict(timing_of(kind, args.shape_change_ms)) for kind in KINDS},
              "ceiling": None if args.no_ceiling else ceilings(counts, args.max_wait_ms, args.repeats),
              "runs": runs}
    report["seconds"] = round(time.perf_counter() - started, 1)
    if report["ceiling"]:
        told = [f"{mode} {c['requests_per_s']:,.0f} req/s p99 {c['p99_ms']:.1f} ms"
                for mode, c in report["ceiling"].items()]
        print("ceiling (instant answers): " + ", ".join(told))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out} in {report['seconds']:.0f} s")


def map_figures(engines: Any, batches: int) -> dict[str, Any]:
    mapped = serving_measure.map_run(engines, MODEL, 16, batches)
    return {k: mapped[k] for k in ("map_ms", "sequential_ms", "sequential_over_map", "map_runs_ms",
                                   "sequential_runs_ms") if k in mapped}


def summary(run: dict[str, Any]) -> str:
    parts = [f"{run['kind']:>9} ctx={run['contexts']} bound {run['bound_rows_per_s']:>6,.0f}"]
    for mode in ("threads", "asyncio"):
        b = run[mode]
        parts.append(f"{mode} {b['requests_per_s']:>6,.0f} req/s p50 {b['p50_ms']:5.1f} p99 {b['p99_ms']:6.1f} ms "
                     f"rows {b['mean_batch_rows']:4.1f} looks {b['looks_per_batch']:5.1f}")
    if "map" in run:
        parts.append(f"map/loop {run['map']['sequential_over_map']:.2f}")
    return " | ".join(parts)


if __name__ == "__main__":
    main()
