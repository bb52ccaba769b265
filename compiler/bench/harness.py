"""``trtc bench``: latency, throughput and accuracy of every way a build can run, on identical inputs.

``bench_directory`` (a build directory) and ``bench_model`` (a model file, exported into a temporary
directory first) run these steps, each in a file of its own:

  inputs     one feed per bucket, the same bytes for every backend: ``--data``, else the build's
             evaluation or calibration data, else seeded random normal values
  reference  the outputs every row is compared with: FP32 eager PyTorch, or ONNX Runtime FP32 on the
             CPU when there is no PyTorch model (an ONNX source)
  plans      which backends and precisions run here (torch, torch-cudagraph, onnxruntime, tensorrt),
             each through a serving context of ``compiler.load``; the others are skipped with the reason
  measure    each plan at every bucket: ``timing`` (device and end-to-end latency), peak device memory
             and ``accuracy``; a backend that fails is a row marked failed, not a crash
  baseline   with ``--baseline``, the rows that got slower than an earlier bench.json allows
  report     bench.json, bench.csv and bench.png, in ``DIR/report/`` unless ``report_dir`` says
             otherwise; ``table`` is the terminal view of the same data

One precision policy per run: FP32 math of every backend uses TF32 or none does (``tf32``; default
the manifest's ``build.tf32``, else True): PyTorch's ``allow_tf32`` flags and ONNX Runtime's
``use_tf32`` are set to match, and TensorRT rows run as their engines were built. The table title
and bench.json say which.

Every column is computed from one statistic, the P50 (median) of the device latency: speed-ups (against
eager PyTorch FP32 at the same bucket), throughput (batch / P50) and regressions; the end-to-end columns
from the end-to-end P50. Rows of a precision ONNX Runtime only emulates (``measure.emulated``) are accuracy
rows: no speed-up. cuDNN autotuning is on while benchmarking.
"""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from dataclasses import asdict
from pathlib import Path

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
from compiler.bench.target import Target, VerifiedOnnx
from compiler.core.errors import InputError
from compiler.core.files import directory_lock, require_directory
from compiler.core.manifest import Manifest, read_manifest
from compiler.core.settings import BenchSettings, ExportSettings
from compiler.core.specs import BATCH_DIM

__all__ = ["bench_directory", "bench_model"]

log = logging.getLogger(__name__)


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


def _bench(directory: Path, manifest: Manifest, settings: BenchSettings, model_mode: bool,
           report_dir: Path) -> BenchReport:
    require_directory(report_dir, "--report-dir")  # before minutes of measurements, not after
    spec = manifest.spec
    buckets = tuple(sorted(set(settings.buckets or manifest.buckets or (1,))))
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
    if any(r.backend == "tensorrt" for r in results) and manifest.build is not None and manifest.tf32 != tf32:
        warnings.append(f"the tensorrt rows run as their engines were built (build.tf32 = {manifest.tf32}), "
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


def _tf32(settings: BenchSettings, manifest: Manifest) -> tuple[bool, str]:
    """The run's TF32 policy and where it came from: ``--tf32``/``--no-tf32``, else ``Manifest.tf32``, the rule
    ``compiler.load`` serves by."""
    if settings.tf32 is not None:
        return settings.tf32, "--tf32" if settings.tf32 else "--no-tf32"
    return manifest.tf32, ("the manifest's build.tf32" if manifest.build is not None
                           else "default (the manifest records no build.tf32)")


def _warnings(results: list[BenchResult], settings: BenchSettings) -> list[str]:
    """The report's warnings: wide spreads, runs stopped by ``--max-seconds``, and what the accuracy rows are."""
    notes = []
    for r in results:
        if r.spread_wide:
            notes.append(f"{r.name} bucket {r.bucket}: wide spread, P90 is {100 * r.spread:.0f}% above P50 "
                         f"(CV {100 * r.cv:.0f}%): another load on the machine? raise --min-seconds")
        if r.stopped_early:
            notes.append(f"{r.name} bucket {r.bucket}: stopped by --max-seconds after {r.iterations} runs")
    for precision in sorted({r.precision for r in results if r.accuracy_only}):
        why = next(r.accuracy_only for r in results if r.accuracy_only and r.precision == precision)
        notes.append(f"onnxruntime/{precision} rows are accuracy rows, not speed rows: {why}; TensorRT's "
                     f"{precision.upper()} speed is the tensorrt row's")
    for note in notes:
        log.debug("%s", note)  # shown with the table, from the report
    return notes


def _with_speedups(results: list[BenchResult]) -> list[BenchResult]:
    """Each row with its speed-up over the torch/fp32 row of its bucket (device and end-to-end P50), where there is
    one."""
    base = {r.bucket: r for r in results if (r.backend, r.precision) == REFERENCE}
    out = []
    for r in results:
        ref = base.get(r.bucket)
        if ref is None or r.accuracy_only:  # an emulated precision's time is no speed-up
            out.append(r)
            continue
        out.append(dataclasses.replace(r, speedup=ref.latency_ms.p50 / r.latency_ms.p50 if r.latency_ms.p50 else None,
                                       e2e_speedup=ref.e2e_ms.p50 / r.e2e_ms.p50 if r.e2e_ms.p50 else None))
    return out
