"""Eager PyTorch vs CUDA graphs vs ONNX Runtime on a GPU machine, for the two bundled benchmark models.

For each model it makes (or reuses) a build directory, then runs ``trtc bench``'s library on it at
buckets 1, 4, 8, 16 with FP32 and FP16 rows (and INT8 ONNX Runtime rows with ``--int8``):

  resnet       examples.models:resnet50_like, images:Bx3x224x224 (a ResNet-style CNN of ResNet-50-like cost)
  transformer  examples.models:transformer_encoder, input_ids/attention_mask: BxS int64, S = 128 (range 1:128:512)

Builds: ``trtc export`` then ``trtc calibrate --fp16`` (and ``--int8``) through the library, calibrated
on RANDOM data: the reduced-precision graphs are for timing, and their accuracy columns say how far
FP16/INT8 drift from FP32 on random inputs only. Every report says so (``calibration`` in summary.json).
A directory from ``trtc build ... --engine none`` can be given instead with ``--build-dir NAME=DIR``.
TensorRT rows run where TensorRT is installed and the build has engines; elsewhere they are listed
as skipped with the reason.

Writes, under --out:
  builds/NAME/          the build directories (unless --build-dir)
  NAME/bench.json|csv|png   the full report of each model (report/bench.json layout of `trtc bench`)
  summary.json          machine, versions, settings, and P50 / throughput / speed-up per model, backend, bucket

Usage (from the repository root; PYTHONPATH must also hold onnx_graphsurgeon, and onnxscript for the
dynamo exporter, else the TorchScript exporter is used):
  python benchmarks/bench_gpu.py --out /tmp/trtc-gpu-bench            # about 5 minutes on one H200
  python benchmarks/bench_gpu.py --out /tmp/trtc-gpu-bench --quick    # about 1-2 minutes, tiny counts
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compiler.bench.harness import bench_directory
from compiler.bench.report import BenchReport
from compiler.bench.table import bench_renderables
from compiler.core.manifest import MANIFEST, read_manifest
from compiler.core.settings import BenchSettings, ExportSettings, ModelSource
from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec

log = logging.getLogger("bench_gpu")

BUCKETS = (1, 4, 8, 16)


@dataclass(frozen=True)
class Model:
    name: str
    factory: str
    inputs: tuple[str, ...]
    dims: tuple[str, ...] = ()

    def spec(self) -> ModelSpec:
        return ModelSpec(tuple(parse_input_spec(i) for i in self.inputs), dict(parse_dim_range(d) for d in self.dims))


MODELS = {
    "resnet": Model("resnet", "examples.models:resnet50_like", ("images:Bx3x224x224:float32",)),
    "transformer": Model("transformer", "examples.models:transformer_encoder",
                         ("input_ids:BxS:int64", "attention_mask:BxS:int64"), ("S=1:128:512",)),
}


def build_directory(model: Model, out: Path, int8: bool, rebuild: bool) -> Path:
    """Export and calibrate (RANDOM data, for timing) into ``out``; reused when its manifest is there."""
    from calibration.calibrate import calibrate_directory
    from compiler.core.settings import CalibrationSettings
    from compiler.pipeline.export import export_directory

    if (out / MANIFEST).is_file() and not rebuild:
        log.info("%s: reusing %s (pass --rebuild to make it again)", model.name, out)
        return out
    start = time.perf_counter()
    export_directory(ExportSettings(ModelSource(factory=model.factory), out, model.spec(), buckets=BUCKETS,
                                    force=True), command="bench_gpu.py")
    for precision in ("int8", "fp16") if int8 else ("fp16",):  # fp16 last: the build's precision is FP16
        calibrate_directory(out, CalibrationSettings(precision, data="random", samples=32, batch_size=8))
    log.info("%s: built %s in %.0f s", model.name, out, time.perf_counter() - start)
    return out


def bench_settings(args: argparse.Namespace, report_dir: Path) -> BenchSettings:
    if args.quick:
        counts: dict[str, Any] = dict(iterations=10, min_seconds=0.2, max_seconds=3.0, warmup=3, warmup_seconds=0.2)
    else:
        counts = dict(iterations=100, min_seconds=2.0, max_seconds=10.0, warmup=10, warmup_seconds=1.0)
    return BenchSettings(buckets=BUCKETS, report_dir=report_dir, ort_providers=tuple(args.ort_providers.split(","))
                         if args.ort_providers else (), **counts)


def summary_rows(report: BenchReport) -> list[dict[str, Any]]:
    return [{"name": r["name"], "bucket": r["bucket"], "runner": r["runner"], "device": r["device"],
             "p50_ms": round(r["latency_ms"]["p50"], 4), "e2e_p50_ms": round(r["e2e_ms"]["p50"], 4),
             "throughput": round(r["throughput"], 1), "speedup": r["speedup"] and round(r["speedup"], 3),
             "spread": round(r["spread"], 3), "peak_memory_mib": r["peak_memory_bytes"] and
             round(r["peak_memory_bytes"] / 2**20, 1), "cosine": r["accuracy"]["cosine"],
             "top1_agreement": r["accuracy"]["top1_agreement"]} for r in report.data["results"]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="Output directory.")
    parser.add_argument("--quick", action="store_true", help="Tiny iteration counts (a smoke run).")
    parser.add_argument("--models", default="resnet,transformer", help="Which models (default both).")
    parser.add_argument("--int8", action="store_true", help="Also an INT8 graph (random calibration) for ORT rows.")
    parser.add_argument("--build-dir", action="append", default=[], metavar="NAME=DIR",
                        help="Use this build directory for model NAME (e.g. from trtc build --engine none).")
    parser.add_argument("--rebuild", action="store_true", help="Rebuild directories under OUT/builds.")
    parser.add_argument("--ort-providers", help="ONNX Runtime providers, best first (default: best usable).")
    args = parser.parse_args()

    from rich.console import Console
    from rich.logging import RichHandler

    logging.basicConfig(level=logging.INFO, handlers=[RichHandler(show_time=False, show_path=False)],
                        format="%(message)s")
    logging.getLogger("torch").setLevel(logging.ERROR)
    console = Console(width=200)
    given = dict(item.split("=", 1) for item in args.build_dir)
    unknown = [m for m in [*args.models.split(","), *given] if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}: choose from {', '.join(MODELS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"models": {}}
    for name in args.models.split(","):
        model = MODELS[name]
        directory = Path(given[name]) if name in given else build_directory(model, args.out / "builds" / name,
                                                                            args.int8, args.rebuild)
        manifest = read_manifest(directory)
        report = bench_directory(directory, bench_settings(args, args.out / name))
        for item in bench_renderables(report):
            console.print(item)
        summary["models"][name] = {
            "factory": model.factory, "inputs": list(model.inputs), "dims": list(model.dims),
            "build": str(directory), "onnx": sorted(manifest.onnx),
            "calibration": "as built: see its report/accuracy.json" if name in given else "random data (timing only)",
            "report": str(report.json_path), "plot": report.data["plot"],
            "reference": report.data["reference"], "results": summary_rows(report), "skipped": report.data["skipped"],
            "warnings": report.data["warnings"]}
        summary.update(machine=report.data["machine"], versions=report.data["versions"],
                       settings=report.data["settings"])
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    console.print(f"wrote {args.out / 'summary.json'} and {', '.join(str(args.out / n) for n in summary['models'])}"
                  "/bench.{json,csv,png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
