"""`trtc serve` under Triton's load generator beside `compiler.load` + `ProcessBatcher` on the same model and machine.

Triton: ``trtc serve MODEL`` runs as a subprocess (the command users run: a trtc entry in a temporary
repository, Triton's dynamic batcher in front of trtc's runtime, one model instance), and ``perf_analyzer``
(Triton's load generator, closed loop: ``C`` requests of batch 1 outstanding at all times, over gRPC)
measures throughput and latency at each concurrency ``C``: ``--repeats`` runs of ``--requests`` requests each
(``--request-count``: a shared host seldom passes perf_analyzer's stability loop) after 200 unmeasured ones;
the table shows the run of median throughput. Throughput is ``C`` over the mean latency (Little's law for a
closed loop: the rate while all ``C`` are outstanding), because perf_analyzer's own Inferences/Second in
request-count mode counts its clients' start-up (292/s for 304 requests at ``C`` 16 whose p50 was 8.7 ms);
its figure is kept in the JSON beside. Triton's statistics endpoint gives the mean
batch it formed at each level. ``--preferred`` runs one ``trtc serve`` per list of preferred batch sizes
(``buckets``: the default, the model's buckets).

In-process: ``compiler.load(MODEL, device=...)`` with one context, a ``ProcessBatcher`` with the same
``max_wait_ms`` as Triton's ``max_queue_delay``, and ``C`` closed-loop clients of batch-1 requests in other
processes (``benchmarks/process_clients.py``): the same load shape as perf_analyzer's, the same counts.

Both use the same input (zeros, batch 1; dynamic dimensions at their optimum) and run one after the other on
the same host, which on a 2-core machine also runs the load generators: the figures compare the two paths
under the same constraint, not the model's ceiling. Writes a JSON and a Markdown table.

    python benchmarks/triton_serving.py --model build/demo/engines --device cpu \\
        --out benchmarks/results/triton_serving_cpu.json
    python benchmarks/triton_serving.py --model build/resnet50 --device cuda \\
        --out benchmarks/results/triton_serving_h200.json

perf_analyzer: taken from ``--perf-analyzer``, PATH, or ``build/perf-analyzer/bin``. The PyPI package
``perf-analyzer`` is a placeholder without the binary, and the ``tritonclient`` wheels that still carry it
need glibc 2.38 from 2.52 on, so this script names the last one that runs on glibc 2.35 (Ubuntu 22.04,
Debian 12): ``pip install --no-deps --target build/perf-analyzer tritonclient==2.51.0``. That binary
links ``libb64.so.0d`` and ``libcudart.so.12``; where the system has neither, links to the copies in
the ``nvidia-pytriton`` wheel (``nvidia_pytriton.libs``) are put on its ``LD_LIBRARY_PATH``.

On a GPU machine (``--device cuda``): the wheel's Triton has the Python backend only (no TensorRT or ONNX
Runtime backend libraries), which is all the trtc entry needs: its instance is a GPU instance
(``KIND_AUTO`` on a machine with GPUs) and ``compiler.load`` runs TensorRT engines there where TensorRT
imports, else ONNX Runtime's CUDA provider.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import process_clients  # noqa: E402

PERF_ANALYZER_WHEEL = "tritonclient==2.51.0"
PERF_ANALYZER_HINT = (f"perf_analyzer was not found: `pip install --no-deps --target build/perf-analyzer "
                      f"{PERF_ANALYZER_WHEEL}` puts it in build/perf-analyzer/bin (or pass --perf-analyzer PATH)")
READY_SECONDS = 300.0
LEVEL_SECONDS = 300  # the bound of one perf_analyzer run (its request count ends it far sooner)
WARMUP_REQUESTS = 200  # sent and not counted before each level's runs
# perf_analyzer's CSV splits the mean latency into these parts (microseconds); they add up to it
LATENCY_PARTS = ("Client Send", "Network+Server Send/Recv", "Server Queue", "Server Compute Input",
                 "Server Compute Infer", "Server Compute Output", "Client Recv")


def find_perf_analyzer(given: str | None) -> Path:
    for candidate in (given, shutil.which("perf_analyzer"), str(ROOT / "build/perf-analyzer/bin/perf_analyzer")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    sys.exit(PERF_ANALYZER_HINT)


def perf_analyzer_libraries(work: Path) -> str:
    """A folder of links named as perf_analyzer asks for its libraries, to the wheel's renamed copies."""
    from compiler.pipeline.tritonserver import find_tritonserver

    folder = work / "perf-analyzer-libs"
    folder.mkdir(exist_ok=True)
    for path in find_tritonserver().library_paths:
        for name, prefix in (("libb64.so.0d", "libb64-"), ("libcudart.so.12", "libcudart-")):
            found = sorted(path.glob(f"{prefix}*")) if path.is_dir() else []
            if found and not (folder / name).exists():
                (folder / name).symlink_to(found[0])
    return str(folder)


def sample(model: Path) -> dict[str, np.ndarray]:
    """One request: batch 1, zeros, dynamic dimensions at their optimum."""
    from compiler.core.manifest import read_manifest

    spec = read_manifest(model).spec
    return {name: np.zeros_like(array) for name, array in spec.example_feed(1, values=spec.opt_values(1)).items()}


class Serve:
    """``trtc serve MODEL`` as a subprocess; stopped with SIGINT (Ctrl-C), killed if it does not stop."""

    def __init__(self, model: Path, preferred: str, max_wait_ms: float) -> None:
        from compiler.pipeline.tritonserver import free_port

        self.ports = [free_port() for _ in range(3)]
        command = [sys.executable, "-c", "from compiler.cli import main; main()", "serve", str(model), "--name",
                   "model", "--port", str(self.ports[0]), "--grpc-port", str(self.ports[1]), "--metrics-port",
                   str(self.ports[2]), "--max-wait-ms", f"{max_wait_ms:g}", "-q"]
        if preferred != "buckets":
            command += ["--preferred-batch-sizes", preferred]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                        env=env, start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.server_pid: int | None = None
        end = time.monotonic() + READY_SECONDS
        while not any("Ctrl-C stops it" in line for line in self.lines):
            if self.process.poll() is not None or time.monotonic() > end:
                self.stop()
                sys.exit("trtc serve did not become ready:\n" + "".join(self.lines[-30:]))
            time.sleep(0.2)
        text = "".join(self.lines)
        self.server_pid = int(text.split("tritonserver pid ")[1].split(")")[0])

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in iter(self.process.stderr.readline, ""):
            self.lines.append(line)

    def stats(self) -> dict[str, Any]:
        url = f"http://127.0.0.1:{self.ports[0]}/v2/models/model/stats"
        with urllib.request.urlopen(url, timeout=30) as answer:
            return json.load(answer)["model_stats"][0]  # type: ignore[no-any-return]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                for group in (self.process.pid, self.server_pid):
                    if group is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(group, signal.SIGKILL)
                self.process.wait(timeout=30)


def perf_analyzer_run(binary: Path, libraries: str, serve: Serve, feed: dict[str, np.ndarray], concurrency: int,
                      requests: int, work: Path) -> dict[str, Any]:
    """One perf_analyzer measurement of exactly ``requests`` requests (``--request-count``: no stability loop, which
    a loaded shared host seldom passes) at ``concurrency``; throughput, p50/p99 and Triton's mean batch."""
    requests = -(-requests // concurrency) * concurrency  # 2.51 hung on a count its clients could not share evenly
    report = work / f"perf-{concurrency}.csv"
    report.unlink(missing_ok=True)
    command = [str(binary), "-m", "model", "-u", f"127.0.0.1:{serve.ports[1]}", "-i", "grpc", "-b", "1",
               "--concurrency-range", f"{concurrency}:{concurrency}", "--request-count", str(requests),
               "--input-data", "zero", "-f", str(report)]
    for name, array in feed.items():
        command += ["--shape", f"{name}:{','.join(str(d) for d in array.shape[1:])}"]
    env = {**os.environ, "LD_LIBRARY_PATH": os.pathsep.join(filter(None, [libraries, os.environ.get(
        "LD_LIBRARY_PATH")]))}
    before = serve.stats()
    ran = subprocess.run(command, capture_output=True, text=True, timeout=LEVEL_SECONDS, env=env)
    after = serve.stats()
    if ran.returncode != 0 or not report.is_file():
        return {"concurrency": concurrency, "error": (ran.stdout + ran.stderr).strip().splitlines()[-1]}
    with open(report) as file:
        row = next(csv.DictReader(file))
    executions = int(after["execution_count"]) - int(before["execution_count"])
    inferences = int(after["inference_count"]) - int(before["inference_count"])
    mean_us = sum(float(row[part]) for part in LATENCY_PARTS)
    return {"concurrency": concurrency, "requests_per_s": concurrency / (mean_us / 1e6),
            "perf_analyzer_inferences_per_s": float(row["Inferences/Second"]),
            "p50_ms": float(row["p50 latency"]) / 1000, "p99_ms": float(row["p99 latency"]) / 1000,
            "mean_ms": mean_us / 1000,
            "mean_batch": inferences / executions if executions else None, "requests": requests}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median throughput (its own latencies with it), and every run's throughput."""
    good = sorted((r for r in runs if "error" not in r), key=lambda r: r["requests_per_s"])
    if not good:
        return runs[-1]
    return {**good[(len(good) - 1) // 2], "runs_requests_per_s": [r["requests_per_s"] for r in good],
            "failed_runs": len(runs) - len(good)}


def in_process_level(model: Path, device: str, feed: dict[str, np.ndarray], concurrency: int, requests: int,
                     repeats: int, max_wait_ms: float) -> dict[str, Any]:
    from compiler.serve.load import load
    from compiler.serve.processes import ProcessBatcher

    runs = []
    with load(model, device=device, contexts=1) as engines, \
            ProcessBatcher(engines, max_wait_ms=max_wait_ms, capacity=max(64, concurrency)) as batcher:
        processes = process_clients.default_processes(concurrency)
        process_clients.run(batcher, [feed] * concurrency, WARMUP_REQUESTS, processes)
        for _ in range(repeats):
            ran = process_clients.run(batcher, [feed] * concurrency, requests, processes)
            latencies = ran["steady_latencies"] if len(ran["steady_latencies"]) else ran["latencies"]
            runs.append({"concurrency": concurrency,
                         "requests_per_s": float(ran["steady_requests_per_s"] or requests / ran["seconds"]),
                         "p50_ms": float(np.percentile(latencies, 50) * 1000),
                         "p99_ms": float(np.percentile(latencies, 99) * 1000), "lost": int(ran["lost"]),
                         "client_processes": int(ran["processes"]), "requests": requests})
    return median_run(runs)


def table(results: dict[str, Any]) -> str:
    lines = ["| path | concurrency | requests/s (runs' range) | p50 ms | p99 ms | mean batch |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for path, rows in results["paths"].items():
        for row in rows:
            if "error" in row:
                lines.append(f"| {path} | {row['concurrency']} | failed: {row['error']} | | | |")
                continue
            batch = f"{row['mean_batch']:.2f}" if row.get("mean_batch") else ""
            runs = row.get("runs_requests_per_s") or [row["requests_per_s"]]
            spread = f" ({min(runs):,.0f}-{max(runs):,.0f})" if len(runs) > 1 else ""
            lines.append(f"| {path} | {row['concurrency']} | {row['requests_per_s']:,.0f}{spread} | "
                         f"{row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {batch} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", type=Path, default=ROOT / "build/demo/engines", help="a build directory")
    parser.add_argument("--device", default="cpu", help="compiler.load's device for the in-process path")
    parser.add_argument("--concurrency", default="1,4,16", help="closed-loop clients, comma-separated")
    parser.add_argument("--preferred", action="append", help="Triton's preferred batch sizes, e.g. 4,8,16 (repeat; "
                        "default: buckets)")
    parser.add_argument("--max-wait-ms", type=float, default=None, help="both batchers' wait for company "
                        "(default: trtc's default)")
    parser.add_argument("--requests", type=int, default=1500, help="requests per run, both paths")
    parser.add_argument("--repeats", type=int, default=3, help="runs per level; the table shows the run of median "
                        "throughput")
    parser.add_argument("--perf-analyzer", help="the perf_analyzer binary")
    parser.add_argument("--skip-in-process", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/triton_serving.json")
    args = parser.parse_args()

    from compiler.core import defaults
    from compiler.pipeline.tritonserver import find_tritonserver

    max_wait_ms = defaults.MAX_WAIT_MS if args.max_wait_ms is None else args.max_wait_ms
    levels = [int(c) for c in args.concurrency.split(",")]
    binary = find_perf_analyzer(args.perf_analyzer)
    install = find_tritonserver()
    feed = sample(args.model)
    results: dict[str, Any] = {
        "model": str(args.model), "device": args.device, "max_wait_ms": max_wait_ms,
        "host": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                 "load_average_at_start": os.getloadavg()},
        "triton": str(install.binary), "perf_analyzer": str(binary),
        "settings": {"requests_per_run": args.requests, "repeats": args.repeats, "warmup_requests": WARMUP_REQUESTS,
                     "protocol": "grpc", "input_data": "zero", "batch": 1},
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "paths": {}}
    with tempfile.TemporaryDirectory(prefix="trtc-triton-bench-") as scratch:
        work = Path(scratch)
        libraries = perf_analyzer_libraries(work)
        for preferred in args.preferred or ["buckets"]:
            serve = Serve(args.model, preferred, max_wait_ms)
            try:
                rows = []
                for c in levels:
                    perf_analyzer_run(binary, libraries, serve, feed, c, WARMUP_REQUESTS, work)
                    rows.append(median_run([perf_analyzer_run(binary, libraries, serve, feed, c, args.requests, work)
                                            for _ in range(args.repeats)]))
            finally:
                serve.stop()
            results["paths"][f"trtc serve (preferred {preferred})"] = rows
            print(table({"paths": {f"trtc serve (preferred {preferred})": rows}}), flush=True)
    if not args.skip_in_process:
        rows = [in_process_level(args.model, args.device, feed, c, args.requests, args.repeats, max_wait_ms)
                for c in levels]
        results["paths"]["compiler.load + ProcessBatcher"] = rows
    results["host"]["load_average_at_end"] = os.getloadavg()
    text = table(results)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    load = results["host"]["load_average_at_start"][0], results["host"]["load_average_at_end"][0]
    args.out.with_suffix(".md").write_text(f"`{results['command']}` on {results['host']['platform']}, "
                                           f"{results['host']['cpus']} CPUs, load average {load[0]:.1f} at the "
                                           f"start and {load[1]:.1f} at the end\n\n{text}\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
