"""``trtc bench``: latency, throughput and accuracy of every way a build can run, on identical inputs.

Backends, each run at every batch bucket. Every row is a serving backend of ``compiler.load``
(``compiler.backends``), one context of it, timed through the context's upload / compute /
download split: the harness measures exactly what is served.

  torch            the source model in eager mode (the torch backend, graphs off): FP32, and under
                   autocast FP16 when the build is FP16/INT8
  torch-cudagraph  the torch backend with its CUDA graph per bucket (CUDA only)
  onnxruntime      every ONNX of the build (fp32, int8, fp16) on the onnxruntime backend: CUDA when
                   present (``ort_providers`` CPUExecutionProvider first keeps it on the CPU)
  tensorrt         the build's engines on the tensorrt backend

One precision policy per run: FP32 math of every backend uses TF32 or none does (``tf32``; default
the manifest's ``build.tf32``, else True): PyTorch's ``allow_tf32`` flags and ONNX Runtime's
``use_tf32`` are set to match, and TensorRT rows run as their engines were built. The table title
and bench.json say which.

A backend that cannot run here is listed in the report's ``skipped`` with the reason; a backend that
fails while running is listed there too, as failed, with the error.

Inputs are made once per bucket and every backend gets the same bytes (their sha256 is in the
report): from ``data`` (an .npz), else from the build's evaluation data or, failing that, its
calibration data (as recorded in ``report/accuracy.json``, when the files are still there), else
seeded random normal values; the report and the table say which. Outputs of each backend's first
run are compared with the FP32 eager PyTorch reference: max abs error, cosine similarity, and top-1
agreement for classifiers only (the accuracy gate used labels, or the output is 2-D and comes from a
linear layer or softmax). Without a PyTorch model (an ONNX source) the reference is ONNX Runtime
FP32 on the CPU.

Timing (``time_runner``): warm-up of at least ``warmup`` runs and ``warmup_seconds``, then at least
``iterations`` runs and at least ``min_seconds`` (``max_seconds`` caps both; stopping early is noted).
Every run uploads the feed, launches and downloads the outputs. The host clock (``perf_counter_ns``)
around all three is the *end-to-end* latency; the launch alone is the *device* latency, timed with
CUDA events on a GPU and with the host clock on the CPU. Speed-ups (against eager PyTorch FP32 at the
same bucket), throughput and regressions use the device latency. cuDNN autotuning is on while
benchmarking. CUDA work runs on the serving context's own stream.

Peak device memory: for the torch backends, torch's allocator peak during the run less what was already
allocated, plus the model's weights; for TensorRT and ONNX Runtime on CUDA, the device-wide drop in free
memory since the runner was created (``cudaMemGetInfo``; other processes on the GPU disturb it); on the
CPU, not measured (None).

Files, in ``DIR/report/`` unless ``report_dir`` says otherwise: ``bench.json`` (everything; layout in
``report_dict``), ``bench.csv`` (one row per backend and bucket, skipped ones included) and ``bench.png``
(latency and throughput against batch size; needs matplotlib, the ``trtc[plot]`` extra).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from compiler.bench.accuracy import accuracy_of, is_classifier
from compiler.bench.baseline import find_regressions, read_baseline
from compiler.bench.inputs import bench_inputs, first_line
from compiler.bench.reference import eager_model, reference_outputs, torch_bench_mode
from compiler.bench.report import (
    REFERENCE,
    BenchReport,
    BenchResult,
    Regression,
    Skipped,
    report_dict,
    write_report,
)
from compiler.bench.settings import BACKENDS, BenchSettings
from compiler.bench.target import Target, VerifiedOnnx
from compiler.bench.timing import Latency, StagedRunner, as_float32, time_runner
from compiler.core import defaults
from compiler.core.errors import InputError, TrtcError
from compiler.core.files import directory_lock, require_directory
from compiler.core.manifest import read_manifest, spec_from_manifest
from compiler.core.settings import ExportSettings
from compiler.core.specs import BATCH_DIM

__all__ = ["bench_directory", "bench_model", "ServedRunner"]

log = logging.getLogger(__name__)

ONNX_PRECISION_ORDER = ("fp32", "fp16", "int8")


# --- what runs ----------------------------------------------------------------------------------------------------

class _Unavailable(Exception):
    """A backend cannot run at this bucket; the message says why."""


class ServedRunner:
    """One context of a serving backend (``compiler.serve.engines.Engines``), staged for ``time_runner``.

    ``upload`` checks the feed as ``engines(x)`` does and queues its copy into the bucket's buffers,
    ``launch`` queues the model run (``compute``), ``download`` queues the outputs' copy to pinned host
    memory, waits, and returns them (floats as float32, for the accuracy columns). The engines are
    closed with the runner.
    """

    def __init__(self, engines: Any, name: str) -> None:
        self.engines = engines
        self.name = name
        self.device = "cuda" if str(engines.device).startswith("cuda") else "cpu"
        self.input_names = list(engines.input_names)
        self.output_names = list(engines.output_names)
        self._borrowed = engines.borrow()
        self._context = self._borrowed.__enter__()
        self.stream = self._context.stream
        self._call: Any = None
        self._bucket = 0

    def upload(self, feed: dict[str, np.ndarray]) -> None:
        call = self.engines.check(dict(feed))
        if call.rows > self.engines.buckets[-1]:
            raise _Unavailable(f"batch {call.rows} is larger than the largest bucket {self.engines.buckets[-1]}")
        self._call, self._bucket = call, self.engines.bucket_for(call.rows)
        self._context.upload(self._bucket, call, 0, call.rows)

    def launch(self) -> None:
        self._context.compute(self._bucket, self._call)

    def download(self) -> dict[str, np.ndarray]:
        self._context.download(True)
        self._context.wait()
        return self._context.copy_outputs()

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.upload(feed)
        self.launch()
        return as_float32(self.download())

    def close(self) -> None:
        self._borrowed.__exit__(None, None, None)
        self.engines.close()


@dataclass
class _Plan:
    """A backend and precision to measure, and how to open its runner (one for every bucket)."""

    backend: str
    precision: str
    open: Callable[[], StagedRunner]
    torch_memory: bool = False  # peak memory from torch's allocator (else the device-wide free-memory delta)
    weight_bytes: int = 0  # the eager model's parameters and buffers, resident before the measurement starts


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _tensorrt_unavailable() -> str | None:
    """Why the tensorrt backend cannot run here, or None."""
    from compiler.core.capabilities import tensorrt_version

    if tensorrt_version() is None:
        return "TensorRT is not installed (no real `tensorrt` imports); install trtc[tensorrt] on a machine " \
               "with an NVIDIA GPU"
    if not _cuda_available():
        return "no CUDA device: torch.cuda.is_available() is False"
    return None


def _plans(target: Target, settings: BenchSettings, device: str, buckets: tuple[int, ...], tf32: bool,
           ) -> tuple[list[_Plan], list[Skipped]]:
    from compiler.backends.onnxrt import OrtBackend
    from compiler.backends.pytorch import TorchBackend
    from compiler.serve.engines import Engines
    from compiler.serve.load import load

    manifest, spec, model = target.manifest, target.spec, target.model
    outputs = list(manifest.get("output_names") or [])
    onnx = manifest.get("onnx") or {}
    reduced = any(p in onnx for p in ("fp16", "int8")) or manifest.get("precision") in ("fp16", "int8")
    torch_precisions = ("fp32", "fp16") if reduced else ("fp32",)
    cuda = _cuda_available()
    plans: list[_Plan] = []
    skipped: list[Skipped] = []
    model_mode_note = ("`trtc bench MODEL` runs eager PyTorch and ONNX Runtime only; build a directory with "
                       "`trtc build` and bench it for the others")

    def skip(backend: str, precision: str | None, reason: str) -> None:
        skipped.append(Skipped(backend, precision, None, reason))

    weights = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) \
        if model is not None and hasattr(model, "parameters") else 0

    def torch_runner(precision: str, graphs: bool) -> Callable[[], StagedRunner]:
        def open_torch() -> StagedRunner:
            backend = TorchBackend(model, spec, buckets, outputs, device, cuda_graphs=graphs,
                                    autocast_fp16=precision == "fp16")
            name = ("torch-cudagraph" if graphs else "torch") + ("[autocast-fp16]" if precision == "fp16" else "")
            return ServedRunner(Engines(backend, contexts=1), name)

        return open_torch

    def ort_runner(path: Path, ort_device: str | None) -> Callable[[], StagedRunner]:
        def open_ort() -> StagedRunner:
            backend = OrtBackend(path, spec, buckets, ort_device, settings.threads, tf32=tf32)
            return ServedRunner(Engines(backend, contexts=1), f"onnxruntime[{backend.provider}]")

        return open_ort

    def trt_runner() -> StagedRunner:
        return ServedRunner(load(target.directory, backend="tensorrt", contexts=1), "tensorrt")

    for backend in BACKENDS:
        if backend not in settings.backends:
            continue
        if backend == "torch":
            for precision in torch_precisions:
                if model is None:
                    skip(backend, precision, target.model_note)
                elif precision == "fp16" and device != "cuda":
                    skip(backend, precision, "autocast FP16 runs on CUDA only, and this run is on the CPU")
                else:
                    plans.append(_Plan(backend, precision, torch_runner(precision, False), torch_memory=True,
                                       weight_bytes=weights))
        elif backend == "torch-cudagraph":
            for precision in torch_precisions:
                if target.model_mode:
                    skip(backend, precision, model_mode_note)
                elif not cuda:
                    skip(backend, precision, "no CUDA device: torch.cuda.is_available() is False")
                elif device != "cuda":
                    skip(backend, precision, "--device cpu: CUDA graphs run on CUDA only")
                elif model is None:
                    skip(backend, precision, target.model_note)
                else:
                    plans.append(_Plan(backend, precision, torch_runner(precision, True), torch_memory=True,
                                       weight_bytes=weights))
        elif backend == "onnxruntime":
            ort_device = _ort_device(settings.ort_providers)
            for precision in sorted(onnx, key=lambda p: ONNX_PRECISION_ORDER.index(p)
                                    if p in ONNX_PRECISION_ORDER else 99):
                plans.append(_Plan(backend, precision, ort_runner(target.onnx.path(precision), ort_device)))
        elif backend == "tensorrt":
            engines = manifest.get("engines") or []
            reason = model_mode_note if target.model_mode else _tensorrt_unavailable()
            if reason is None and not engines:
                note = str(manifest.get("engines_note") or "not built")
                reason = f"the build has no TensorRT engines ({note.removeprefix('not built: ')}); " \
                         f"build them with `trtc build` where TensorRT is installed"
            if reason is not None:
                skip(backend, None, reason)
                continue
            plans.append(_Plan(backend, _engine_precision(engines[0], manifest), trt_runner))
    return plans, skipped


def _ort_device(providers: tuple[str, ...]) -> str | None:
    """The onnxruntime backend's device for ``--ort-providers``: the CPU when it comes first, else CUDA when usable.

    The serving backend runs the CUDA provider or the CPU; a TensorRT EP asked for is run as CUDA, with a warning.
    """
    if not providers:
        return None
    if providers[0] == "CPUExecutionProvider":
        return "cpu"
    if providers[0] != "CUDAExecutionProvider":
        log.warning("--ort-providers %s: the onnxruntime backend serves with the CUDA provider or the CPU; running "
                    "with CUDA where usable", providers[0])
    return None


def _engine_precision(entry: dict[str, Any], manifest: dict[str, Any]) -> str:
    """The precision of the ONNX an engine was built from (its ``onnx`` file), else the build's precision."""
    for precision, onnx_entry in (manifest.get("onnx") or {}).items():
        if onnx_entry.get("file") == entry.get("onnx"):
            return str(precision)
    return str((manifest.get("build") or {}).get("precision") or manifest.get("precision") or "fp32")


# --- measuring ----------------------------------------------------------------------------------------------------

def _free_device_memory() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def _release_device_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _measure(plan: _Plan, runner: StagedRunner, bucket: int, feed: dict[str, np.ndarray],
             reference: dict[str, np.ndarray], settings: BenchSettings, free_before_open: int | None,
             context: _RunContext) -> BenchResult:
    """Time ``runner`` at one bucket (CUDA work on the runner's stream) and compare its first outputs with
    ``reference``."""
    import torch

    cuda = runner.device == "cuda"
    resident = 0
    if cuda and plan.torch_memory:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = int(torch.cuda.memory_allocated())
    timing = time_runner(runner, feed, settings)
    memory: int | None = None
    method: str | None = None
    if cuda and plan.torch_memory:
        # what this run added to what was already allocated (weights, other runs' cuBLAS workspaces), plus weights
        memory = int(torch.cuda.max_memory_allocated()) - resident + plan.weight_bytes
        method = "torch.cuda.max_memory_allocated during the run, less what it found allocated, plus the weights"
    elif cuda and free_before_open is not None:
        free_now = _free_device_memory()
        if free_now is not None:
            memory, method = max(0, free_before_open - free_now), "device-wide cudaMemGetInfo delta since the " \
                                                                  "runner was created"
    latency, e2e = Latency.of(timing.device_ms), Latency.of(timing.e2e_ms)
    wide = latency.spread > settings.max_spread
    accuracy = accuracy_of(timing.outputs, reference, bucket, top1=context.classifier, data=context.data)
    result = BenchResult(
        backend=plan.backend, precision=plan.precision, bucket=bucket, runner=runner.name, device=runner.device,
        clock=timing.clock, iterations=len(timing.e2e_ms), seconds=round(timing.seconds, 4),
        stopped_early=timing.stopped_early, latency_ms=latency, e2e_ms=e2e,
        throughput=bucket * 1000.0 / latency.mean if latency.mean > 0 else float("inf"),
        e2e_throughput=bucket * 1000.0 / e2e.mean if e2e.mean > 0 else float("inf"),
        spread=latency.spread, cv=latency.cv, spread_wide=wide, peak_memory_bytes=memory, memory_method=method,
        accuracy=accuracy, dims=dict(context.dims[bucket]))
    log.info("%s bucket %d on %s: P50 %.3f ms (end to end %.3f ms), %d runs, cosine %.6f", result.name, bucket,
             runner.name, latency.p50, e2e.p50, result.iterations, accuracy.cosine)
    return result


@dataclass(frozen=True)
class _RunContext:
    """What every measurement of one run shares: whether top-1 applies, where the inputs came from, dynamic dims."""

    classifier: bool
    data: str
    dims: dict[int, dict[str, int]]


def _run_plan(plan: _Plan, buckets: tuple[int, ...], feeds: dict[int, dict[str, np.ndarray]],
              reference: dict[int, dict[str, np.ndarray]], settings: BenchSettings, context: _RunContext,
              ) -> tuple[list[BenchResult], list[Skipped]]:
    """Measure one backend at every bucket, with one serving context opened for all of them. A failure is
    recorded (failed=True) with its error, not raised: the other backends still run, and the report and table
    show it."""
    results: list[BenchResult] = []
    skipped: list[Skipped] = []
    try:
        free_before = _free_device_memory()
        try:
            runner = plan.open()
        except _FAILURES as err:  # the runner shared by all buckets: each bucket would fail the same way
            return results, [Skipped(plan.backend, plan.precision, None, _failure(plan, buckets[0], err), failed=True)]
        try:
            for bucket in buckets:
                try:
                    results.append(_measure(plan, runner, bucket, feeds[bucket], reference[bucket], settings,
                                            free_before, context))
                except _Unavailable as why:
                    skipped.append(Skipped(plan.backend, plan.precision, bucket, str(why)))
                except _FAILURES as err:
                    skipped.append(Skipped(plan.backend, plan.precision, bucket, _failure(plan, bucket, err),
                                           failed=True))
        finally:
            runner.close()
    finally:
        _release_device_memory()
    return results, skipped


_FAILURES = (TrtcError, RuntimeError, OSError, ValueError, ImportError)  # a backend that fails is a row, not a crash


def _failure(plan: _Plan, bucket: int, err: BaseException) -> str:
    """The report's reason for a failed backend, logged as a warning (the traceback at debug level)."""
    reason = f"failed: {type(err).__name__}: {first_line(err)}"
    log.warning("%s/%s at bucket %d %s", plan.backend, plan.precision, bucket, reason)
    log.debug("traceback", exc_info=True)
    return reason


def _with_speedups(results: list[BenchResult]) -> list[BenchResult]:
    base = {r.bucket: r for r in results if (r.backend, r.precision) == REFERENCE}
    out = []
    for r in results:
        ref = base.get(r.bucket)
        if ref is None:
            out.append(r)
            continue
        out.append(dataclasses.replace(r, speedup=ref.latency_ms.p50 / r.latency_ms.p50 if r.latency_ms.p50 else None,
                                       e2e_speedup=ref.e2e_ms.p50 / r.e2e_ms.p50 if r.e2e_ms.p50 else None))
    return out


# --- entry points -------------------------------------------------------------------------------------------------

def bench_directory(directory: Path, settings: BenchSettings) -> BenchReport:
    """Benchmark a build directory (``trtc export``/``calibrate``/``build`` output); writes the report files.

    Holds the directory's lock while it runs, so that no build changes the files under it.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    with directory_lock(directory, "trtc bench"):
        return _bench(directory, manifest, settings, model_mode=False,
                      report_dir=settings.report_dir or directory / "report")


def bench_model(export: ExportSettings, settings: BenchSettings) -> BenchReport:
    """``trtc bench MODEL``: export ``export.source`` into a temporary directory, then benchmark eager PyTorch
    and ONNX Runtime FP32 on it. Reports go to ``settings.report_dir`` (default ``./bench-report``)."""
    from compiler.pipeline.export import export_directory

    with tempfile.TemporaryDirectory(prefix="trtc-bench-") as tmp:
        build = Path(tmp) / "build"
        manifest = export_directory(dataclasses.replace(export, out=build, force=True), command="trtc bench")
        return _bench(build, manifest, settings, model_mode=True,
                      report_dir=settings.report_dir or Path("bench-report"))


def _bench(directory: Path, manifest: dict[str, Any], settings: BenchSettings, model_mode: bool,
           report_dir: Path) -> BenchReport:
    require_directory(report_dir, "--report-dir")  # before minutes of measurements, not after
    spec = spec_from_manifest(manifest)
    buckets = tuple(sorted(set(settings.buckets or manifest.get("buckets") or (1,))))
    device = settings.device or ("cuda" if _cuda_available() else "cpu")
    if device == "cuda" and not _cuda_available():
        raise InputError("--device cuda, but torch.cuda.is_available() is False here; use --device cpu")
    feeds, data_source = bench_inputs(None if model_mode else directory, manifest, spec, buckets, settings.seed,
                                      settings.data)
    tf32, tf32_source = _tf32(settings, manifest)
    onnx_paths = VerifiedOnnx(directory, manifest)
    context = _RunContext(is_classifier(directory, manifest, onnx_paths), data_source,
                          {b: {d: int(next(a.shape[axis] for n, a in feed.items() if n == i.name))
                               for i in spec.inputs for axis, d in enumerate(i.dims) if isinstance(d, str)
                               and d != BATCH_DIM} for b, feed in feeds.items()})
    baseline = read_baseline(settings.baseline, manifest) if settings.baseline else None
    results: list[BenchResult] = []
    with torch_bench_mode(tf32):
        model, model_note = eager_model(manifest, device, settings.trust_pickle, directory)
        target = Target(directory, manifest, spec, model, model_note, model_mode, onnx_paths)
        reference, reference_name = reference_outputs(target, feeds, device)
        plans, skipped = _plans(target, settings, device, buckets, tf32)
        for plan in plans:
            got, missed = _run_plan(plan, buckets, feeds, reference, settings, context)
            results += got
            skipped += missed
    results = _with_speedups(results)
    warnings = _warnings(results, settings)
    engines_tf32 = (manifest.get("build") or {}).get("tf32")
    if any(r.backend == "tensorrt" for r in results) and engines_tf32 is not None and bool(engines_tf32) != tf32:
        warnings.append(f"the tensorrt rows run as their engines were built (build.tf32 = {bool(engines_tf32)}), "
                        f"the other rows with TF32 {'on' if tf32 else 'off'}; rebuild or rerun with the same setting")
    data = report_dict(directory if not model_mode else None, manifest, settings, device, reference_name, feeds,
                       results, skipped, warnings)
    data["tf32"] = {"enabled": tf32, "source": tf32_source,
                    "applies_to": "FP32 math of every row: torch allow_tf32 (matmul, cuDNN), ONNX Runtime CUDA "
                                  "use_tf32; tensorrt rows as their engines were built"}
    data["inputs"]["source"] = data_source
    data["classifier"] = context.classifier
    regressions: list[Regression] = []
    if baseline is not None:
        regressions, compared, not_compared = find_regressions(data, baseline, settings.max_regression)
        data["baseline"] = {"file": str(settings.baseline), "created": baseline.get("created"),
                            "max_regression": settings.max_regression, "compared": compared,
                            "not_compared": not_compared, "regressions": [asdict(r) for r in regressions]}
    return write_report(data, report_dir, settings.plot, regressions)


def _tf32(settings: BenchSettings, manifest: dict[str, Any]) -> tuple[bool, str]:
    """The run's TF32 policy and where it came from."""
    from compiler.backends.trt_build import recorded_tf32  # the rule compiler.load serves by

    if settings.tf32 is not None:
        return settings.tf32, "--tf32" if settings.tf32 else "--no-tf32"
    recorded = (manifest.get("build") or {}).get("tf32") is not None
    return recorded_tf32(manifest.get("build")), ("the manifest's build.tf32" if recorded
                                   else "default (the manifest records no build.tf32)")


def _warnings(results: list[BenchResult], settings: BenchSettings) -> list[str]:
    notes = []
    for r in results:
        if r.spread_wide:
            notes.append(f"{r.name} bucket {r.bucket}: wide spread, P90 is {100 * r.spread:.0f}% above P50 "
                         f"(CV {100 * r.cv:.0f}%): another load on the machine? raise --min-seconds")
        if r.stopped_early:
            notes.append(f"{r.name} bucket {r.bucket}: stopped by --max-seconds after {r.iterations} runs")
    int8_cpu = [r for r in results if r.backend == "onnxruntime" and r.precision == "int8" and "CPU" in r.runner
                and r.accuracy is not None and r.accuracy.cosine < defaults.GATE_MIN_COSINE]
    if int8_cpu:
        notes.append("onnxruntime/int8 on the CPU differs from FP32 more than the accuracy gate measured: ONNX "
                     "Runtime's fused integer kernels saturate on x86 CPUs without VNNI; the gate runs the Q/DQ "
                     "exactly as TensorRT does (report/accuracy.json)")
    for note in notes:
        log.debug("%s", note)  # shown with the table, from the report
    return notes
