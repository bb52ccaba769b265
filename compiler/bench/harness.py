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
import logging
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from compiler.bench.accuracy import is_classifier
from compiler.bench.baseline import find_regressions, read_baseline
from compiler.bench.inputs import bench_inputs
from compiler.bench.measure import RunContext, measure_plan
from compiler.bench.plans import cuda_available, plans_for
from compiler.bench.reference import eager_model, reference_outputs, torch_bench_mode
from compiler.bench.report import (
    REFERENCE,
    BenchReport,
    BenchResult,
    Regression,
    report_dict,
    write_report,
)
from compiler.bench.settings import BenchSettings
from compiler.bench.target import Target, VerifiedOnnx
from compiler.core import defaults
from compiler.core.errors import InputError
from compiler.core.files import directory_lock, require_directory
from compiler.core.manifest import read_manifest, spec_from_manifest
from compiler.core.settings import ExportSettings
from compiler.core.specs import BATCH_DIM

__all__ = ["bench_directory", "bench_model"]

log = logging.getLogger(__name__)


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
    device = settings.device or ("cuda" if cuda_available() else "cpu")
    if device == "cuda" and not cuda_available():
        raise InputError("--device cuda, but torch.cuda.is_available() is False here; use --device cpu")
    feeds, data_source = bench_inputs(None if model_mode else directory, manifest, spec, buckets, settings.seed,
                                      settings.data)
    tf32, tf32_source = _tf32(settings, manifest)
    onnx_paths = VerifiedOnnx(directory, manifest)
    context = RunContext(is_classifier(directory, manifest, onnx_paths), data_source,
                          {b: {d: int(next(a.shape[axis] for n, a in feed.items() if n == i.name))
                               for i in spec.inputs for axis, d in enumerate(i.dims) if isinstance(d, str)
                               and d != BATCH_DIM} for b, feed in feeds.items()})
    baseline = read_baseline(settings.baseline, manifest) if settings.baseline else None
    results: list[BenchResult] = []
    with torch_bench_mode(tf32):
        model, model_note = eager_model(manifest, device, settings.trust_pickle, directory)
        target = Target(directory, manifest, spec, model, model_note, model_mode, onnx_paths)
        reference, reference_name = reference_outputs(target, feeds, device)
        plans, skipped = plans_for(target, settings, device, buckets, tf32)
        for plan in plans:
            got, missed = measure_plan(plan, buckets, feeds, reference, settings, context)
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
