"""INT8 calibration cost against sample count, next to plain inference and onnxruntime's quantize_static.

The model is the bundled ResNet-style CNN at 3x224x224 (examples.models.resnet_cnn, widths 32-256, one
basic block per stage, stride-2 stem: 0.8 GMAC a sample). The data are smoothed random images (low-frequency
noise upsampled, plus fine noise), written as a folder of .npz files of 64 samples, so that what is measured
is the calibration's memory, not the data's. For each sample count N, each job in a fresh interpreter that
reports its own peak RSS (VmHWM) and wall and CPU time:

* ``infer``: plain FP32 inference of the N samples in ONNX Runtime, batches of 16, read from the same files
  (timed after the session is created and warmed up, so the comparison is strict);
* ``trtc``: ``calibrate_directory`` (trtc calibrate --int8 --calib-samples N), percentile 99.99, with the
  accuracy gate on a held-out set of 64 samples (cosine, as without labels); its stages are timed, and
  "without gate" is the whole run less the gate's FP32 reference and INT8 evaluation (a fixed cost of
  the held-out set, not of N);
* ``ort``: ``onnxruntime.quantization.quantize_static`` with ``CalibrationMethod.Percentile`` on the same N
  samples, where memory allows: it keeps every activation of every sample, so it is skipped when the
  estimate exceeds ``--ort-budget-gib`` (default 16, or 60% of the free memory if less).

Both INT8 models are scored by the mean row cosine of their logits against FP32 on the held-out samples,
Q/DQ executed exactly as TensorRT would (ort_session's SESSION_POLICY).

Targets from the calibration issue: peak RSS at 1024 samples within 10% of the peak at 64, and calibration
time at most 2x plain inference of the same samples (checked on the time without the gate).

Usage:
    python benchmarks/calibration_bench.py [--sizes 64,256,1024] [--out benchmarks/results/calibration_bench.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

FILE_SAMPLES = 64  # samples per .npz file
BATCH = 16
EVAL_SAMPLES = 64
SHAPE = (3, 224, 224)
WIDTHS = (32, 64, 128, 256)
GIB = 1 << 30


# --- data and model ---------------------------------------------------------------------------------------------

def write_images(folder: Path, samples: int, seed: int) -> None:
    """Smoothed random images, about N(0, 1) per channel like normalized photos, FILE_SAMPLES to a file."""
    import torch

    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, samples, FILE_SAMPLES):
        n = min(FILE_SAMPLES, samples - start)
        coarse = torch.randn(n, 3, 7, 7, generator=gen)
        medium = torch.randn(n, 3, 28, 28, generator=gen)
        x = torch.nn.functional.interpolate(coarse, size=SHAPE[1:], mode="bicubic", align_corners=False)
        x = x + 0.5 * torch.nn.functional.interpolate(medium, size=SHAPE[1:], mode="bilinear", align_corners=False)
        x = x + 0.1 * torch.randn(n, *SHAPE, generator=gen)
        contrast = 0.5 + torch.rand(n, 1, 1, 1, generator=gen)
        x = (x - x.mean(dim=(2, 3), keepdim=True)) / x.std(dim=(2, 3), keepdim=True) * contrast
        np.savez(folder / f"{start // FILE_SAMPLES:04d}.npz", images=x.numpy().astype(np.float32))


def export_model(directory: Path) -> dict[str, Any]:
    """The CNN as an ExportedProgram (dynamic batch), then `trtc export` into ``directory``."""
    import torch

    from compiler.core.settings import ExportSettings, ModelSource
    from compiler.pipeline.export import export_directory
    from examples.models import resnet_cnn

    model = resnet_cnn(in_channels=3, num_classes=1000, widths=WIDTHS, blocks_per_stage=1, stem_stride=2)
    batch = torch.export.Dim("batch", min=1, max=64)
    program = torch.export.export(model, (torch.randn(2, *SHAPE),), dynamic_shapes=({0: batch},))
    directory.mkdir(parents=True)
    torch.export.save(program, directory / "cnn.pt2")
    return export_directory(ExportSettings(ModelSource(directory / "cnn.pt2"), directory / "fp32", buckets=(1, BATCH)))


def activation_bytes_per_sample(onnx_path: Path) -> int:
    """Bytes of every float tensor the graph computes for one sample: what quantize_static keeps per sample."""
    import onnx

    model = onnx.shape_inference.infer_shapes(onnx.load(str(onnx_path), load_external_data=False))
    total = 0
    for info in list(model.graph.value_info) + list(model.graph.output):
        t = info.type.tensor_type
        if t.elem_type != onnx.TensorProto.FLOAT or not t.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else 1 for d in t.shape.dim]  # batch -> 1
        total += 4 * math.prod(dims)
    return total


def batches(folder: Path, limit: int, batch: int = BATCH) -> Any:
    """Batches of ``batch`` samples from the first ``limit`` samples of ``folder``, read file by file."""
    seen = 0
    for path in sorted(folder.glob("*.npz")):
        with np.load(path) as npz:
            images = npz["images"]
        for i in range(0, len(images), batch):
            if seen >= limit:
                return
            chunk = images[i:i + min(batch, limit - seen)]
            seen += len(chunk)
            yield {"images": chunk}


# --- the measured jobs, each run in its own process ----------------------------------------------------------------

def job_infer(args: argparse.Namespace) -> dict[str, Any]:
    from compiler.core.onnx_io import ort_session

    session = ort_session(Path(args.model))
    session.run(None, {"images": np.zeros((1, *SHAPE), np.float32)})  # warm-up, as calibration's first batch is
    start, cpu = time.perf_counter(), time.process_time()
    compute = 0.0
    for feed in batches(Path(args.data), args.samples):
        t = time.perf_counter()
        session.run(None, feed)
        compute += time.perf_counter() - t
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu,
            "compute_seconds": compute}


def job_trtc(args: argparse.Namespace) -> dict[str, Any]:
    import calibration.calibrate as stage
    from calibration.calibrate import calibrate_directory
    from compiler.core.settings import CalibrationSettings, GateSettings

    # time the stages by wrapping what calibrated_into calls (names as calibration/calibrate.py imports them)
    stages: dict[str, float] = {}
    peaks: dict[str, float] = {}  # peak RSS when each stage last ended: where memory went

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                stages[name] = stages.get(name, 0.0) + time.perf_counter() - t
                peaks[name] = round(peak_rss_mib(), 1)
        return wrapper

    for name, attr in (("read and check data", "calibration_data"), ("histograms", "collect_histograms"),
                       ("Q/DQ graph", "qdq_model_from"), ("gate: FP32 reference", "_evaluator"),
                       ("gate: INT8 evaluation", "gate_with_fallback"), ("save ONNX", "save_onnx")):
        setattr(stage, attr, timed(name, getattr(stage, attr)))
    directory = Path(args.model)
    settings = CalibrationSettings("int8", data=args.data, samples=args.samples, batch_size=BATCH,
                                   eval_data=args.eval, gate=GateSettings(min_cosine=0.99))
    start, cpu = time.perf_counter(), time.process_time()
    calibrate_directory(directory, settings)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu
    report = json.loads((directory / "report" / "accuracy.json").read_text())["int8"]
    gate = stages.get("gate: FP32 reference", 0.0) + stages.get("gate: INT8 evaluation", 0.0)
    return {"seconds": seconds, "cpu_seconds": cpu_seconds, "without_gate_seconds": seconds - gate,
            "stages": {k: round(v, 2) for k, v in stages.items()}, "peak_rss_mib_after": peaks,
            "samples": report["calibration_data"]["samples"], "kept_in_fp32": len(report["kept_in_fp32"]),
            "gate_cosine": report["accuracy"]["cosine_mean"]}


def job_ort(args: argparse.Namespace) -> dict[str, Any]:
    from onnxruntime.quantization import CalibrationDataReader, CalibrationMethod, quantize_static

    class Reader(CalibrationDataReader):  # type: ignore[misc]
        def __init__(self) -> None:
            self.items = batches(Path(args.data), args.samples)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.items, None)

    start, cpu = time.perf_counter(), time.process_time()
    quantize_static(args.model, args.output, Reader(), calibrate_method=CalibrationMethod.Percentile)
    return {"seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu}


JOBS = {"infer": job_infer, "trtc": job_trtc, "ort": job_ort}


def peak_rss_mib() -> float:
    """This process's peak RSS (VmHWM).

    Not getrusage: on Linux a child's ru_maxrss (and so RUSAGE_CHILDREN, and os.wait4's) starts from its
    parent's RSS at fork, so a job started by a parent that holds torch and the model would report the
    parent's peak. VmHWM belongs to the address space, which exec replaces.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_job(job: str, log: Path, **options: Any) -> dict[str, Any]:
    """Run one job in a fresh interpreter; returns its result, which includes its ``peak_rss_mib``."""
    result_path = log.with_suffix(".json")
    cmd = [sys.executable, __file__, "--job", job, "--result", str(result_path)]
    for key, value in options.items():
        cmd += [f"--{key.replace('_', '-')}", str(value)]
    with open(log, "w") as out:
        code = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, check=False).returncode
    if code != 0:
        raise RuntimeError(f"{job} failed with exit code {code}; see {log}:\n{log.read_text()[-3000:]}")
    return json.loads(result_path.read_text())


def mean_cosine(fp32: Path, candidate: Path, eval_folder: Path) -> float:
    from calibration.accuracy import row_cosines
    from compiler.core.onnx_io import ort_session

    reference, session = ort_session(fp32), ort_session(candidate)
    cosines = [row_cosines(session.run(None, feed)[0], reference.run(None, feed)[0])
               for feed in batches(eval_folder, EVAL_SAMPLES)]
    return float(np.concatenate(cosines).mean())


# --- the benchmark ------------------------------------------------------------------------------------------------

def ort_budget_gib(cap: float) -> float:
    try:
        import psutil

        return min(cap, 0.6 * psutil.virtual_memory().available / GIB)
    except ImportError:
        return cap


def benchmark(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    sizes = sorted(int(s) for s in args.sizes.split(","))
    start = time.perf_counter()
    export_model(work / "model")
    fp32 = work / "model" / "fp32" / "model.onnx"
    write_images(work / "calib", max(sizes), seed=0)
    write_images(work / "eval", EVAL_SAMPLES, seed=1)
    per_sample = activation_bytes_per_sample(fp32)
    budget = ort_budget_gib(args.ort_budget_gib)
    print(f"exported and wrote data in {time.perf_counter() - start:.0f} s; activations {per_sample / 2**20:.1f} "
          f"MiB a sample; quantize_static budget {budget:.1f} GiB", flush=True)
    rows: list[dict[str, Any]] = []
    for n in sizes:
        row: dict[str, Any] = {"samples": n}
        row["infer"] = run_job("infer", work / f"infer-{n}.log", model=fp32, data=work / "calib", samples=n)
        directory = work / f"trtc-{n}"
        shutil.copytree(work / "model" / "fp32", directory)
        trtc = run_job("trtc", work / f"trtc-{n}.log", model=directory, data=work / "calib", samples=n,
                       eval=work / "eval")
        trtc["cosine"] = mean_cosine(fp32, directory / "model.int8.onnx", work / "eval")
        trtc["time_vs_inference"] = round(trtc["seconds"] / row["infer"]["seconds"], 2)
        trtc["without_gate_vs_inference"] = round(trtc["without_gate_seconds"] / row["infer"]["seconds"], 2)
        trtc["cpu_vs_inference"] = round(trtc["cpu_seconds"] / row["infer"]["cpu_seconds"], 2)
        row["trtc"] = trtc
        need_gib = ort_memory_gib(n, per_sample, rows, row["infer"]["peak_rss_mib"])
        if need_gib > budget:
            row["ort"] = {"skipped": f"would need {need_gib:.1f} GiB (budget {budget:.1f} GiB)"}
        else:
            output = work / f"ort-{n}.onnx"
            row["ort"] = run_job("ort", work / f"ort-{n}.log", model=fp32, data=work / "calib", samples=n,
                                 output=output)
            row["ort"]["cosine"] = mean_cosine(fp32, output, work / "eval")
            row["ort"]["estimated_gib"] = round(need_gib, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    first, last = rows[0]["trtc"]["peak_rss_mib"], rows[-1]["trtc"]["peak_rss_mib"]
    return {
        "model": {"factory": "examples.models:resnet_cnn", "widths": list(WIDTHS), "stem_stride": 2,
                  "input": "images:Bx" + "x".join(map(str, SHAPE)),
                  "activation_mib_per_sample": round(per_sample / 2**20, 2)},
        "batch": BATCH, "eval_samples": EVAL_SAMPLES, "rows": rows,
        "targets": {
            "rss_growth": round(last / first - 1, 3), "rss_within_10_percent": last <= 1.1 * first,
            "max_without_gate_vs_inference": max(r["trtc"]["without_gate_vs_inference"] for r in rows),
            "time_within_2x": all(r["trtc"]["without_gate_vs_inference"] <= 2 for r in rows)},
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_average_at_end": os.getloadavg()},
        "seconds": round(time.perf_counter() - start, 1),
    }


def ort_memory_gib(n: int, per_sample: int, rows: list[dict[str, Any]], base_mib: float) -> float:
    """quantize_static's expected peak: scaled from its last measured run, else 2x all activations of N samples."""
    measured = [r for r in rows if "peak_rss_mib" in r.get("ort", {})]
    if measured:
        last = measured[-1]
        growth = max(last["ort"]["peak_rss_mib"] - base_mib, 0.0) / last["samples"]
        return (base_mib + growth * n) / 1024
    return (base_mib * 2**20 + 2 * n * per_sample) / GIB


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("N", "infer s", "trtc s", "no gate s", "hist s", "no gate / infer", "CPU s trtc / infer",
                  "trtc MiB", "trtc cos", "ORT s", "ORT MiB", "ORT cos",
                  title="INT8 calibration, ResNet-style CNN 3x224x224, ORT CPU")
    for r in result["rows"]:
        trtc, ort = r["trtc"], r["ort"]
        ort_cols = ([f"{ort['seconds']:.1f}", f"{ort['peak_rss_mib']:.0f}", f"{ort['cosine']:.5f}"]
                    if "skipped" not in ort else [ort["skipped"], "-", "-"])
        table.add_row(str(r["samples"]), f"{r['infer']['seconds']:.1f}", f"{trtc['seconds']:.1f}",
                      f"{trtc['without_gate_seconds']:.1f}", f"{trtc['stages'].get('histograms', 0):.1f}",
                      f"{trtc['without_gate_vs_inference']:.2f}x",
                      f"{trtc['cpu_seconds']:.0f} / {r['infer']['cpu_seconds']:.0f}", f"{trtc['peak_rss_mib']:.0f}",
                      f"{trtc['cosine']:.5f}", *ort_cols)
    console = Console(width=160)
    console.print(table)
    t = result["targets"]
    rows = result["rows"]
    console.print(f"trtc peak RSS from {rows[0]['samples']} to {rows[-1]['samples']} samples: "
                  f"{100 * t['rss_growth']:+.1f}% (target <= +10%: {'met' if t['rss_within_10_percent'] else 'MISSED'})"
                  f"; calibration without the gate at most {t['max_without_gate_vs_inference']:.2f}x plain "
                  f"inference (target <= 2x: {'met' if t['time_within_2x'] else 'MISSED'})")
    for r in rows:
        console.print(f"  N={r['samples']}: " + ", ".join(f"{k} {v:.1f} s" for k, v in r["trtc"]["stages"].items()))


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,256,1024", help="Calibration sample counts (default 64,256,1024).")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "calibration_bench.json")
    parser.add_argument("--workdir", type=Path, help="Keep models, data and logs here (default: a temp dir).")
    parser.add_argument("--ort-budget-gib", type=float, default=16.0,
                        help="Skip quantize_static where its estimated memory exceeds this (default 16).")
    # the internal job interface: one measured job per process
    parser.add_argument("--job", choices=sorted(JOBS), help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    for name in ("model", "data", "eval", "output"):
        parser.add_argument(f"--{name}", help=argparse.SUPPRESS)
    parser.add_argument("--samples", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.job:
        result = JOBS[args.job](args)
        Path(args.result).write_text(json.dumps({**result, "peak_rss_mib": round(peak_rss_mib(), 1)}))
        return
    if args.workdir:
        args.workdir.mkdir(parents=True, exist_ok=False)
        result = benchmark(args, args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="calibration-bench-") as tmp:
            result = benchmark(args, Path(tmp))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
