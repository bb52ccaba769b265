"""The serving table on a GPU: every path a user takes, each cell against its target, in under nine minutes.

For torchvision's ResNet-50 (``--model-factory torchvision.models:resnet50``, 3x224x224, buckets 1,16,64; skipped,
with the reason in the JSON, where torchvision does not import) this builds directories with ``trtc build
--engine none`` at FP16 for ONNX Runtime (calibrated on random data: speed only) and FP32 for torch (the source
model, CUDA graphs), and measures, for ONNX Runtime with 1 and 2 contexts, torch with 2 and 1, and TensorRT (its
engines by ``trtc rebuild``) with 1 and 2 where it imports and the time budget leaves room:

* the bound: ``engines(x)`` at the largest bucket from host numpy arrays (and, beside it, ``run_parts`` of the
  largest bucket's rows as single-row feeds, and with 2 contexts ``engines(x)`` from 2 threads at once);
* ``ProcessBatcher``, 4 spawned processes x 48 coroutines awaiting ``BatcherClient.infer``, 28,800 requests:
  throughput >= 80 % of the bound, and with 2 contexts p99 <= the 1-context p99 + one batch time; with 2 contexts
  also at ``in_flight=1`` (which is faster);
* ``DynamicBatcher`` in one process, 128 coroutines awaiting ``infer`` (two batches of the largest bucket: one
  running, one forming), 20,000 requests: >= 80 % of the bound, and on ONNX Runtime p99 <= max_wait + 2 x batch
  time; beside it the same at 192 coroutines (``asyncio_deep``), held to throughput only: a closed loop of 192
  clients at 80 % of the bound has a mean latency (192 / its rate, 25.6 ms on an H200's ResNet-50) above that p99;
* ``DynamicBatcher`` in one process, 64 threads blocking in ``submit``, 4,000 requests: >= 50 % of min(bound, the
  batcher's ceiling with instant answers here), p99 <= max_wait + 3 x batch time; beside it the same cell with
  the interpreter's GIL switch interval left at CPython's 5 ms (``switch_interval=None``: what the batcher's
  default of 0.5 ms buys), not a target;
* ``map`` over 100 batches of 16 against the plain loop, five runs of each in turns: map's median no slower than
  the loop's (within ``MAP_TOLERANCE``, or half the larger spread of either's five runs where that is larger);

and in every batcher cell nothing lost (errors, timeouts), misrouted (a row that is not the caller's) or duplicated
(rows the engines ran beyond the requests). Every batcher cell also records ``p99_bound_ms`` (max_wait + 2 batch
times; 3 for threads) and ``closed_loop_mean_ms``, clients / throughput: the mean latency of a closed loop of that
many clients at that rate (Little's law), below which no p99 can be. For 192 clients at about the bound it can
exceed max_wait + 2 batch times (torch's), so the p99 of processes and of torch's coroutines is recorded, not
held to that. Batcher clients stop sending after ``--cell-seconds`` (a collapsed cell costs no more than that).
Each batcher cell records where a batch's time went (``trace``: rows, the start, started
to the batcher's finish call, the finish, bucket changes per batch), and each configuration whether its runs launch
every kernel from the host (``launches_on_host``: no CUDA graphs) and the buckets its engines serve. The CNN and the
transformer of ``examples.models`` add the map row (``--models NAME:map`` measures only the bound and map).

Writes one JSON (``--out``) and prints the table. ``--smoke`` runs tiny models on the CPU in a minute (the test
suite runs it). On an H200, with onnxruntime-gpu first on PYTHONPATH (about 7 minutes; ``--budget-s`` caps it):

    python benchmarks/serving_gpu.py --out benchmarks/results/serving_gpu.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import serving_measure as measure  # noqa: E402
from benchmarks.serving_measure import Model  # noqa: E402

MAX_WAIT_MS = 5.0
MAP_TOLERANCE = 0.02  # map's median may be this much slower than the loop's and count as no slower (run-to-run noise)


@dataclass(frozen=True)
class Cell:
    """One row of the table: a batcher mode with its clients and requests (or ``map``)."""

    name: str
    mode: str  # serving_measure.batcher_run's mode, or "map"
    clients: int
    requests: int
    client_processes: int | None = None


def cells_for(smoke: bool) -> list[Cell]:
    if smoke:
        return [Cell("processes", "processes-asyncio", 8, 160, 2), Cell("asyncio", "asyncio", 8, 160),
                Cell("threads", "threads", 8, 160), Cell("map", "map", 0, 0)]
    return [Cell("processes", "processes-asyncio", 192, 28_800, 4), Cell("asyncio", "asyncio", 128, 20_000),
            Cell("asyncio_deep", "asyncio", 192, 20_000), Cell("threads", "threads", 64, 4_000),
            Cell("map", "map", 0, 0)]


def models_for(smoke: bool, names: Sequence[str] = ()) -> list[tuple[Model, bool]]:
    """(model, whether only its bound and map are measured) for ``names`` (``NAME`` or ``NAME:map``); by default
    torchvision's ResNet-50 with every cell, then the CNN and the transformer with map only (the segmenter, whose
    outputs are seven times its inputs, only when named). With ``smoke`` the CNN takes every cell."""
    buckets, side, seq = ((1, 4, 8), 16, 16) if smoke else ((1, 16, 64), 224, 128)
    cnn = (Model("cnn", "examples.models:resnet_digits", ("images:Bx1x8x8",), (), buckets, {}) if smoke else
           Model("resnet50", "examples.models:resnet50_like", ("images:Bx3x224x224",), (), buckets, {}))
    known = [Model("torchvision-resnet50", "torchvision.models:resnet50", (f"images:Bx3x{side}x{side}",), (), buckets,
                   {}),
             cnn,
             Model("transformer", "examples.models:transformer_encoder",
                   ("input_ids:BxS:int64", "attention_mask:BxS:int64"), (f"S=1:{seq}:{seq}",), buckets, {"S": seq}),
             Model("segmenter", "examples.models:segmenter", (f"images:Bx3x{side}x{side}",), (), buckets, {})]
    by_name = {m.name: m for m in known}
    if not names:
        names = ["cnn", "transformer:map"] if smoke else ["torchvision-resnet50", "resnet50:map", "transformer:map"]
    chosen = []
    for name in names:
        base, _, only = name.partition(":")
        if base not in by_name or only not in ("", "map"):
            sys.exit(f"--models {','.join(names)}: no model {name}; choose from {', '.join(by_name)} (NAME:map for "
                     "the bound and map only)")
        chosen.append((by_name[base], only == "map"))
    return chosen


def unavailable(model: Model) -> str | None:
    """Why ``model``'s factory cannot be imported here (torchvision beside a torch it was not built for), or None.
    Asked in a subprocess: a failed import of torchvision can leave torch's operator registry half written."""
    module = model.factory.split(":")[0]
    if module.startswith("examples."):
        return None
    done = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=300)
    if done.returncode == 0:
        return None
    lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
    return f"import {module} failed: {lines[-1] if lines else f'exit code {done.returncode}'}"


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


def configs_for(backends: Sequence[str]) -> list[tuple[str, str, int]]:
    """(backend, precision, contexts) in the order they run: ONNX Runtime's and torch's first."""
    order = {"onnxruntime": [("fp16", 1), ("fp16", 2)], "torch": [("fp32", 2), ("fp32", 1)],
             "tensorrt": [("fp16", 1), ("fp16", 2)]}
    return [(b, p, c) for b in ("onnxruntime", "torch", "tensorrt") if b in backends for p, c in order[b]]


def cell_targets(cell: Cell, result: dict[str, Any], bound: dict[str, Any], ceiling: float | None,
                 one_context: dict[str, Any] | None, backend: str) -> dict[str, bool]:
    """The targets of one cell (the module docstring); ``one_context``: the same cell with one context (processes)."""
    if cell.mode == "map":
        # no slower: within MAP_TOLERANCE, or within half the larger spread of the two medians' own runs (a busy
        # host's noise, which either series carries; where map is the loop, the same calls, it is all there is)
        spread = max((max(runs) - min(runs)) for runs in (result.get("sequential_runs_ms") or [result["sequential_ms"]],
                                                          result.get("map_runs_ms") or [result["map_ms"]]))
        result["tolerance"] = max(MAP_TOLERANCE, spread / (2 * result["sequential_ms"]))
        return {"map_not_slower_than_loop": result["map_ms"] <= result["sequential_ms"] * (1 + result["tolerance"])}
    batch_ms = bound["batch_ms_mean"]
    if cell.name == "threads":
        rate = 0.5 * min(bound["rows_per_s"], ceiling or bound["rows_per_s"])
        p99 = MAX_WAIT_MS + 3 * batch_ms
    else:
        rate, p99 = 0.8 * bound["rows_per_s"], MAX_WAIT_MS + 2 * batch_ms
    result["throughput_target"], result["p99_bound_ms"] = rate, p99
    result["closed_loop_mean_ms"] = 1e3 * cell.clients / result["requests_per_s"] if result["requests_per_s"] else None
    targets = {f"{cell.name}_throughput": result["requests_per_s"] >= rate,
               f"{cell.name}_nothing_lost": result["lost"] == result["misrouted"] == result["duplicated_rows"] == 0}
    if cell.name == "threads" or (cell.name == "asyncio" and backend == "onnxruntime"):
        targets[f"{cell.name}_p99"] = result["p99_ms"] is not None and result["p99_ms"] <= p99
    if cell.name == "processes" and one_context is not None and one_context.get("p99_ms") is not None:
        result["p99_bound_vs_one_context_ms"] = one_context["p99_ms"] + batch_ms
        targets["processes_p99_vs_one_context"] = (result["p99_ms"] is not None
                                                   and result["p99_ms"] <= one_context["p99_ms"] + batch_ms)
    return targets


def run_cell(cell: Cell, engines: Any, model: Model, contexts: int, args: argparse.Namespace,
             **options: Any) -> dict[str, Any]:
    if cell.mode == "map":
        return measure.map_run(engines, model, args.map_batch, args.map_batches)
    kept = ("clients", "client_processes", "in_flight", "answered", "lost", "misrouted", "duplicated_rows", "seconds",
            "requests_per_s", "requests_per_s_whole_run", "p50_ms", "p99_ms", "p99_ms_whole_run", "batches",
            "mean_batch_rows", "mean_batch_ms", "trace", "batcher_thread_busy", "batches_in_areas")
    result = measure.batcher_run(engines, model, args.workers, cell.clients, cell.requests, MAX_WAIT_MS,
                                 mode=cell.mode, client_processes=cell.client_processes, cap_s=args.cell_seconds,
                                 **options)
    return {k: result[k] for k in kept if k in result}


def ceilings_for(engines: Any, model: Model, cells: list[Cell], args: argparse.Namespace) -> dict[str, Any]:
    """The batchers with instant answers (``InstantEngines``) in each cell's mode: their own ceiling here."""
    one = measure.feed_of(engines, model, engines.buckets[-1], seed=1)
    ready = engines(one if len(one) > 1 else next(iter(one.values())))
    ready = ready if isinstance(ready, dict) else {engines.output_names[0]: ready}
    instant = measure.InstantEngines(engines, {n: np.asarray(a) for n, a in ready.items()})
    out = {}
    for cell in cells:
        if cell.mode != "map":
            run = measure.batcher_run(instant, model, 1, cell.clients, cell.requests, MAX_WAIT_MS, mode=cell.mode,
                                      check_rows=False, client_processes=cell.client_processes,
                                      cap_s=args.cell_seconds)
            out[cell.name] = {k: run[k] for k in ("clients", "requests_per_s", "p50_ms", "p99_ms") if k in run}
    return out


def measure_config(model: Model, map_only: bool, directory: Path, backend: str, precision: str, contexts: int,
                   cells: list[Cell], ceilings: dict[str, Any], one_context: dict[tuple[str, str], Any],
                   args: argparse.Namespace, device: str | None) -> dict[str, Any]:
    """Every cell of one configuration (only the bound and map when ``map_only``), with its targets."""
    from compiler.serve.load import load

    engines = load(directory, backend=backend, contexts=contexts, device=device)
    try:
        largest = engines.buckets[-1]
        one = measure.feed_of(engines, model, largest, seed=1)
        bound = measure.throughput(engines, one if len(one) > 1 else next(iter(one.values())), largest, args.seconds)
        run: dict[str, Any] = {"model": model.name, "backend": backend, "precision": precision, "contexts": contexts,
                               "workers": args.workers, "device": engines.device,
                               "buckets": list(engines.buckets),
                               "buffer_sets": engines.buffer_sets, "launches_on_host": engines.launches_on_host,
                               "starts_at_once": engines.starts_at_once, "bound": bound, "cells": {}, "targets": {}}
        if not map_only:
            # what packing single-row requests costs against one contiguous array, and two callers at once
            feed = one if len(one) > 1 else next(iter(one.values()))
            run["run_parts"] = measure.parts_throughput(engines, one, largest, args.seconds)
            run["parallel_calls"] = (measure.parallel_throughput(engines, feed, largest, contexts, args.seconds)
                                     if contexts > 1 else None)
            if not ceilings:
                ceilings.update(ceilings_for(engines, model, cells, args))
        for cell in cells:
            if map_only and cell.mode != "map":
                continue
            result = run_cell(cell, engines, model, contexts, args)
            run["cells"][cell.name] = result
            run["targets"].update(cell_targets(cell, result, bound, ceilings.get(cell.name, {}).get("requests_per_s"),
                                               one_context.get((backend, cell.name)) if contexts > 1 else None,
                                               backend))
            if cell.name == "threads":  # what the batcher's switch interval buys: the same cell at CPython's 5 ms
                run["cells"]["threads_switch_5ms"] = run_cell(cell, engines, model, contexts, args,
                                                              switch_interval=None)
            if contexts == 1:
                one_context[(backend, cell.name)] = result
            if cell.name == "processes" and contexts > 1 and engines.queues_on_gpu:  # is in_flight=1 faster with two?
                run["cells"]["processes_in_flight_1"] = run_cell(cell, engines, model, contexts, args, in_flight=1)
        return run
    finally:
        engines.close()


def table_of(runs: list[dict[str, Any]], cells: list[Cell], smoke: bool) -> Any:
    from rich.table import Table

    table = Table("model", "backend", "ctx", "bound rows/s",
                  *[h for c in cells if c.mode != "map" for h in (f"{c.name} req/s", "p99 ms")], "map/loop", "missed",
                  title=f"serving at its bound ({'smoke, ' if smoke else ''}max_wait {MAX_WAIT_MS:g} ms)")
    for r in runs:
        got = r["cells"]
        row = []
        for c in cells:
            if c.mode == "map":
                continue
            b = got.get(c.name)
            row += [f"{b['requests_per_s']:,.0f}", f"{b['p99_ms']:.1f}" if b["p99_ms"] is not None else "-"] if b else [
                "-", "-"]
        m = got.get("map")
        missed = [k for k, ok in r["targets"].items() if not ok]
        table.add_row(r["model"], f"{r['backend']}/{r['precision']}", str(r["contexts"]),
                      f"{r['bound']['rows_per_s']:,.0f}", *row,
                      f"{m['sequential_over_map']:.2f}x" if m else "-", ", ".join(missed) or "none")
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="The JSON to write.")
    parser.add_argument("--work", type=Path, default=Path("build/serving-gpu"), help="Build directories go here.")
    parser.add_argument("--smoke", action="store_true", help="Tiny models and counts, on the CPU.")
    parser.add_argument("--backends", default="", help="onnxruntime,torch,tensorrt (default: those that run here).")
    parser.add_argument("--models", default="",
                        help="Models by name, NAME:map for the bound and map only (default: torchvision-resnet50, "
                             "resnet50:map, transformer:map; with --smoke cnn, transformer:map). Known: "
                             "torchvision-resnet50, resnet50 (cnn with --smoke), transformer, segmenter.")
    parser.add_argument("--budget-s", type=float, default=480.0,
                        help="Seconds the whole run may take: a configuration that would start later than this less "
                             "its expected time is skipped, and said so in the JSON (default 480).")
    parser.add_argument("--cell-seconds", type=float, help="Seconds a batcher cell's clients send at most (default "
                        "6; 3 with --smoke).")
    parser.add_argument("--seconds", type=float, help="Seconds per engines(x) throughput (default 1.5; 0.2 smoke).")
    parser.add_argument("--map-batches", type=int, help="Batches per map run (default 100; 8 with --smoke).")
    parser.add_argument("--map-batch", type=int, help="Rows per map batch (default 16; 4 with --smoke).")
    parser.add_argument("--workers", type=int, default=1, help="DynamicBatcher workers in its cells (default 1, the "
                        "batcher's own default).")
    args = parser.parse_args()
    smoke = args.smoke
    args.cell_seconds = args.cell_seconds or (3.0 if smoke else 6.0)
    args.seconds = args.seconds if args.seconds is not None else (0.2 if smoke else 1.5)
    args.map_batches = args.map_batches or (8 if smoke else 100)
    args.map_batch = args.map_batch or (4 if smoke else 16)
    started = time.perf_counter()

    import torch
    from rich.console import Console

    from compiler.core.capabilities import tensorrt_version

    cuda = torch.cuda.is_available()
    if not cuda and not smoke:
        sys.exit("serving_gpu needs a CUDA GPU (torch.cuda.is_available() is False); --smoke runs on the CPU")
    if cuda:
        import onnxruntime

        preload = getattr(onnxruntime, "preload_dlls", None)  # onnxruntime-gpu: its CUDA libraries before a session
        if preload is not None:
            preload()
    device = "cpu" if smoke and not cuda else None
    trt = tensorrt_version() is not None and cuda
    wanted = [b for b in args.backends.split(",") if b] or ["onnxruntime", "torch", *(["tensorrt"] if trt else [])]
    console = Console(width=None if sys.stdout.isatty() else 200)
    cells = cells_for(smoke)
    runs: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    ceilings: dict[str, dict[str, Any]] = {}
    for model, map_only in models_for(smoke, [m for m in args.models.split(",") if m]):
        why = unavailable(model)
        left = args.budget_s - (time.perf_counter() - started)
        if not why and left < 120.0:  # its two builds and one configuration
            why = f"over the time budget ({left:.0f} s left)"
        if why:
            skipped.append({"model": model.name, "why": why})
            console.print(f"{model.name}: skipped ({why})")
            continue
        dirs = {p: build(model, p, args.work, False) for p in ("fp32", "fp16")}
        one_context: dict[tuple[str, str], Any] = {}
        ceilings[model.name] = {}
        with_engines: set[str] = set()  # precisions whose TensorRT engines are built
        for backend, precision, contexts in configs_for(wanted):
            left = args.budget_s - (time.perf_counter() - started)
            # seconds a configuration takes on an H200: its load, the bound, each cell and its share of the ceilings
            # (TensorRT's engine build comes on top: about two minutes for three buckets)
            expected = (15.0 if map_only else 12.0 * len(cells) + 10.0) + (
                120.0 if backend == "tensorrt" and precision not in with_engines else 0.0)
            if left < expected:
                skipped.append({"model": model.name, "backend": backend, "contexts": str(contexts),
                                "why": f"over the time budget ({left:.0f} s left, about {expected:.0f} s needed)"})
                continue
            if backend == "tensorrt" and precision not in with_engines:
                build(model, precision, args.work, True)  # its engines, by trtc rebuild
                with_engines.add(precision)
            run = measure_config(model, map_only, dirs[precision], backend, precision, contexts, cells,
                                 ceilings[model.name], one_context, args, device)
            runs.append(run)
            console.print(summary(run))
        for run in runs:  # torch runs two contexts first: its process cell is held to one context's p99 afterwards
            alone = one_context.get((run["backend"], "processes"))
            cell = run["cells"].get("processes")
            if (run["model"] == model.name and run["contexts"] > 1 and cell is not None and alone is not None
                    and "processes_p99_vs_one_context" not in run["targets"]):
                run["targets"].update(cell_targets(cells[0], cell, run["bound"], None, alone, run["backend"]))
    console.print(table_of(runs, cells, smoke))
    machine = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
               "gpu": torch.cuda.get_device_name(0) if cuda else None}
    import onnxruntime

    machine["onnxruntime"] = onnxruntime.__version__
    report = {"kind": "trtc-serving-table", "smoke": smoke, "command": " ".join(sys.argv), "machine": machine,
              "settings": {"max_wait_ms": MAX_WAIT_MS, "cell_seconds": args.cell_seconds, "budget_s": args.budget_s,
                           "seconds": args.seconds, "map_batches": args.map_batches, "map_batch": args.map_batch,
                           "map_runs": measure.MAP_RUNS, "map_tolerance": MAP_TOLERANCE, "backends": wanted,
                           "workers": args.workers,
                           "cells": [vars(c) for c in cells]},
              "seconds": round(time.perf_counter() - started, 1), "runs": runs, "batcher_ceiling": ceilings,
              "skipped": skipped, "all_targets_met": bool(runs) and all(all(r["targets"].values()) for r in runs)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    console.print(f"wrote {args.out} in {report['seconds']:.0f} s")


def summary(run: dict[str, Any]) -> str:
    """One line per configuration as it finishes."""
    parts = [f"{run['model']} {run['backend']}/{run['precision']} contexts={run['contexts']}: bound "
             f"{run['bound']['rows_per_s']:,.0f} rows/s ({run['bound']['batch_ms_mean']:.2f} ms), launches on host "
             f"{run['launches_on_host']}, buckets {run['buckets']}"]
    for name, b in run["cells"].items():
        if name == "map":
            parts.append(f"map {b['map_ms']:.2f} ms vs loop {b['sequential_ms']:.2f} ms")
        else:
            parts.append(f"{name} {b['requests_per_s']:,.0f} req/s p99 {b['p99_ms'] or 0:.1f} ms batch "
                         f"{b['mean_batch_rows']:.0f} rows")
    missed = [k for k, ok in run["targets"].items() if not ok]
    return "; ".join(parts) + (f"; missed {', '.join(missed)}" if missed else "")


if __name__ == "__main__":
    main()
