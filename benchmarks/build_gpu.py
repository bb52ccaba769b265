"""End-to-end `trtc build` time of torchvision's ViT-B/16 on a GPU machine, INT8 and FP16, 512 samples each.

For each precision it runs, in a fresh process and a fresh output directory,

    trtc build --model-factory benchmarks.sized_models:torchvision_vit_b16 --input images:Bx3x224x224 --buckets 1,8
        --int8|--fp16 --calib-data random --calib-samples 512 --engine none --out WORK/vit-PRECISION

and records the wall time and the build's own time record, WORK/vit-PRECISION/report/timing.json: every stage in
the order it ran (interpreter start and torch import, imports, checks before export, model loading, fingerprint,
export, export check, graph passes, writing model.onnx, pass check, source snapshot, calibration, ...), the
process's seconds and what no stage holds. ``stages_sum_seconds`` is their sum; ``wall_minus_stages_seconds``,
the wall time less that sum (the commit, the summary, the exit and process start-up), should be under a second.
Also the times calibration.json and report/accuracy.json hold, where each step ran (ONNX Runtime provider of the
export checks, calibration, FP16 range pass and gate; whether the INT8 histograms were binned on the GPU).
Random weights and random data: this measures time, not accuracy. Target: each build within TARGET_S (30 s)
on an H200. Where torchvision is not installed, ``--model-factory benchmarks.sized_models:vit_b16`` is a ViT-B/16
of the same shapes written here.

Then, unless --no-binning-check, it checks the GPU binning on the INT8 build's FP32 model in a separate
process: the same calibration pass (--check-samples samples, runs of whole batches) once with the
histograms binned on the host (numpy) and once on the GPU (torch), both from the same CUDA session
outputs; it records both times and how many histogram counts differ (expected: none, unless ONNX
Runtime's CUDA kernels are not deterministic from run to run, which the percentile amax would show).

The JSON is rewritten after every step, so a crash leaves what was measured; each build's full log is
in WORK/vit-PRECISION.log and its last lines in the JSON when it fails. Last, where pytest is installed, it runs
the GPU tests of the calibration statistics and the export checks (``pytest -m gpu``). A build is killed after
150 s, the check after 120 s and the tests after 90 s. ``--rounds`` (default 2) builds each precision that many times,
one round after the other, each a row with its ``round``: a host's speed varies from build to build (the export
alone took 10.8-15.2 s in four builds on one H200 host).

Usage (from the repository root, on the GPU machine; about 4 minutes on an H200):
    python benchmarks/build_gpu.py --out benchmarks/results/build_gpu.json [--work /tmp/trtc-build-gpu]
On a CPU machine, the stage record of a small model (about 30 s on 2 cores):
    python benchmarks/build_gpu.py --model-factory examples.models:resnet_cnn --input images:Bx3x32x32 \
        --samples 64 --precisions int8 --rounds 1 --no-binning-check --no-gpu-tests --out /tmp/build_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TARGET_S = 30  # seconds a ViT-B/16 build may take on an H200, INT8 or FP16
# a build is killed after BUILD_TIMEOUT_S, the binning check after CHECK_TIMEOUT_S, the GPU tests after TESTS_TIMEOUT_S:
# even then the script ends within 9 minutes (2 x 150 + 120 + 90 s, plus a few seconds of imports)
BUILD_TIMEOUT_S = 150
CHECK_TIMEOUT_S = 120
TESTS_TIMEOUT_S = 90
# their @pytest.mark.gpu tests
GPU_TESTS = ["tests/calibration/test_statistics.py", "tests/compiler/frontend/test_verify.py"]
# stage lines of compiler.core.progress.stage_timer in a log that is not a terminal: "INFO     export: 3.2 s"
_STAGE = re.compile(r"^(?:INFO\s+)?(?P<name>[A-Za-z0-9][A-Za-z0-9 ]*?): (?P<seconds>\d+(?:\.\d+)?) s\s*$")
_BINNED = re.compile(r"binned on (?P<where>\S+)")
# stages that nest inside another one: left out of the sum that gives the time outside every stage
_NESTED = {"INT8 accuracy gate", "FP16 accuracy gate"}


def _env() -> dict[str, str]:
    # a wide console: rich wraps log lines at 80 columns where stdout is not a terminal
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "COLUMNS": "250", "PYTHONUNBUFFERED": "1"}


def stage_times(log: str) -> dict[str, float]:
    """``{stage: seconds}`` from a build's log (a stage logged twice, as "INT8 calibration" is by the build and by
    calibrate, keeps its longest time)."""
    times: dict[str, float] = {}
    for line in log.splitlines():
        match = _STAGE.match(line.strip())
        if match:
            name = match["name"].strip()
            times[name] = max(times.get(name, 0.0), float(match["seconds"]))
    return times


def build(work: Path, precision: str, samples: int, factory: str, inputs: str, buckets: str) -> dict[str, Any]:
    out = work / f"vit-{precision}"
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "compiler.cli", "build", "--model-factory", factory, "--input", inputs,
           "--buckets", buckets, f"--{precision}", "--calib-data", "random", "--calib-samples", str(samples),
           "--engine", "none", "--out", str(out)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        code, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as err:
        code = -1
        log = (err.stdout or b"").decode() if isinstance(err.stdout, bytes) else (err.stdout or "")
        log += f"\n[build_gpu] killed after {BUILD_TIMEOUT_S} s"
    seconds = time.perf_counter() - start
    (work / f"vit-{precision}.log").write_text(log)
    logged = stage_times(log)
    timing_file = out / "report" / "timing.json"
    timing = json.loads(timing_file.read_text()) if timing_file.is_file() else None
    row: dict[str, Any] = {"precision": precision, "samples": samples, "seconds": round(seconds, 2),
                           "exit_code": code, "command": " ".join(cmd[1:]), "logged_stages": logged,
                           "log": str(work / f"vit-{precision}.log")}
    if timing is not None:  # the build's own record: its stages sum to its process's seconds
        total = sum(timing["stages"].values())
        row.update({"stages": timing["stages"], "process_seconds": timing["process_seconds"],
                    "unaccounted_seconds": timing["unaccounted_seconds"], "stages_sum_seconds": round(total, 2),
                    "wall_minus_stages_seconds": round(seconds - total, 2),
                    "stages_sum_to_wall_within_1s": abs(seconds - total) <= 1.0})
    else:  # a failed build writes no record: what its log says
        row["outside_stages_seconds"] = round(seconds - sum(v for k, v in logged.items() if k not in _NESTED), 1)
    binned = _BINNED.search(log)
    row["histograms_binned_on"] = binned["where"] if binned else None
    # a GPU check judged on the CPU, binning that fell back to the host, a module that could not run on CUDA
    row["warnings"] = [" ".join(line.split()) for line in log.splitlines() if line.lstrip().startswith("WARNING")]
    if code:
        row["output_tail"] = log[-4000:]
        return row
    manifest = json.loads((out / "manifest.json").read_text())
    report = json.loads((out / "report" / "accuracy.json").read_text())[precision]
    calibration = json.loads((out / "calibration.json").read_text()) if (out / "calibration.json").is_file() else {}
    row.update({"export_seconds": manifest.get("export", {}).get("seconds"),
                "passes_seconds": manifest.get("export", {}).get("passes_seconds"),
                "export_checks_on": manifest.get("verification", {}).get("devices"),
                "calibration_and_gate_seconds": report.get("seconds"),
                "histogram_pass_seconds": calibration.get("seconds"),
                "gate_seconds": report.get("gate_seconds"),
                "ranking_seconds": report.get("ranking_seconds"),
                "gate_provider": (report.get("accuracy") or {}).get("provider"),
                "gate_fp16_emulated": (report.get("accuracy") or {}).get("fp16_emulated"),
                "gate_summary": manifest.get("accuracy", {}).get(precision, {}).get("summary"),
                "calibration_provider": manifest.get("calibration", {}).get("provider"),
                "calibration_binned_on": calibration.get("binned_on"),
                "fp16_range_provider": manifest.get("fp16", {}).get("range_provider"),
                "target_s": TARGET_S, "target_met": seconds <= TARGET_S})
    stage = (row.get("stages") or logged).get(f"{precision.upper()} calibration")
    if stage is not None and report.get("seconds") is not None:
        # the calibration's own time less the build's wait for it: what ran beside the export and pass checks
        row["calibration_beside_checks_seconds"] = round(report["seconds"] - stage, 1)
    return row


def import_seconds() -> float:
    """Wall time of a fresh interpreter importing what `trtc build` imports before it does anything."""
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, onnxruntime, compiler.cli"], env=_env(), cwd=ROOT,
                   check=False, capture_output=True)
    return round(time.perf_counter() - start, 1)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"platform": platform.platform(), "python": platform.python_version(),
                            "cpus": os.cpu_count()}
    try:
        import onnxruntime as ort
        import torch

        info.update(torch=torch.__version__, onnxruntime=ort.__version__, ort_providers=ort.get_available_providers(),
                    gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except ImportError as err:
        info["note"] = str(err)
    from compiler.core.capabilities import checking_providers

    info["checking_providers"] = checking_providers()
    info["dlpack"] = dlpack_check()
    return info


def dlpack_check() -> str:
    """Whether a CUDA OrtValue reaches torch through DLPack without a copy (what the GPU binning relies on)."""
    try:
        import numpy as np
        import onnxruntime as ort
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
        if hasattr(ort, "preload_dlls"):
            ort.preload_dlls()
        host = np.arange(12, dtype=np.float32).reshape(3, 4)
        value = ort.OrtValue.ortvalue_from_numpy(host, "cuda", 0)
        tensor = torch.from_dlpack(value)
        same_memory = tensor.data_ptr() == value.data_ptr()
        equal = bool(np.array_equal(tensor.cpu().numpy(), host))
        return f"ok: {tensor.device}, shares memory {same_memory}, values equal {equal}"
    except Exception as err:  # reported, not raised: the builds still run and say where they binned
        return f"failed: {type(err).__name__}: {err}"


def binning_check(model: Path, inputs: str, samples: int) -> dict[str, Any]:
    """The INT8 histogram pass on ``model`` binned on the host and on the GPU, from the same CUDA session."""
    import numpy as np

    from calibration.data import calibration_data
    from calibration.fp16 import float_tensors  # the FP16 remainder's max |x| rides along, as in the build
    from calibration.observe import collect_histograms
    from calibration.qdq import tensors_to_calibrate
    from compiler.core.capabilities import checking_providers
    from compiler.core.onnx_io import load_onnx
    from compiler.core.specs import ModelSpec, parse_input_spec

    spec = ModelSpec(tuple(parse_input_spec(text) for text in inputs.split(",")))
    data = calibration_data("random", spec, max_samples=samples)
    graph = load_onnx(model, load_weights=False)
    tensors, floats = tensors_to_calibrate(graph), float_tensors(graph)
    providers = checking_providers()
    result: dict[str, Any] = {"model": str(model), "samples": samples, "batch": data.batch_size,
                              "tensors": len(tensors), "max_abs_tensors": len(floats), "providers": providers}
    whole_batches = 1 << 34  # both paths run whole batches: the same ONNX Runtime runs
    stats = {}
    for device in ("host", "auto"):
        start = time.perf_counter()
        stats[device] = collect_histograms(model, tensors, data.batches(), providers=providers, device=device,
                                           budget_bytes=whole_batches, device_budget_bytes=whole_batches,
                                           max_abs_names=floats)
        result[f"{device}_seconds"] = round(time.perf_counter() - start, 2)
        result[f"{device}_binned_on"] = stats[device].binned_on
    host, gpu = stats["host"], stats["auto"]
    differ = [n for n in tensors if not np.array_equal(host.histograms[n].counts, gpu.histograms[n].counts)]
    result["tensors_with_different_counts"] = len(differ)
    result["counts_moved"] = int(sum(np.abs(host.histograms[n].counts - gpu.histograms[n].counts).sum()
                                     for n in differ))
    result["upper_differs"] = sum(host.histograms[n].upper != gpu.histograms[n].upper for n in tensors)
    amax_host, amax_gpu = host.amax("percentile"), gpu.amax("percentile")
    result["max_relative_amax_difference"] = max(abs(amax_gpu[n] - amax_host[n]) / amax_host[n] for n in tensors)
    result["max_abs_equal"] = host.max_abs == gpu.max_abs
    start = time.perf_counter()  # the GPU path as the build runs it: runs sized by the default device budget
    collect_histograms(model, tensors, data.batches(), providers=providers, max_abs_names=floats)
    result["default_budget_seconds"] = round(time.perf_counter() - start, 2)
    return result


def run_binning_check(work: Path, inputs: str, samples: int) -> dict[str, Any]:
    model = work / "vit-int8" / "model.onnx"
    if not model.is_file():
        return {"skipped": f"{model} is missing (the INT8 build failed?)"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--binning-check", str(model), "--input", inputs,
           "--check-samples", str(samples)]
    try:
        proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=CHECK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"failed": f"killed after {CHECK_TIMEOUT_S} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        return {"failed": f"exit code {proc.returncode}", "output_tail": (proc.stdout + proc.stderr)[-4000:]}
    return dict(json.loads(lines[-1]))


def run_gpu_tests() -> dict[str, Any]:
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"skipped": "pytest is not installed here"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", *GPU_TESTS]
    try:
        proc = subprocess.run(cmd, env=_env(), cwd=ROOT, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"failed": f"killed after {TESTS_TIMEOUT_S} s"}
    return {"command": " ".join(cmd[1:]), "exit_code": proc.returncode,
            "output_tail": (proc.stdout + proc.stderr)[-3000:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/trtc-build-gpu"))
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--precisions", default="int8,fp16")
    parser.add_argument("--model-factory", default="benchmarks.sized_models:torchvision_vit_b16")
    parser.add_argument("--input", default="images:Bx3x224x224")
    parser.add_argument("--buckets", default="1,8")
    parser.add_argument("--check-samples", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="Builds of each precision, one round after the other, "
                        "each a row with its round (default 2: a host's speed varies from build to build).")
    parser.add_argument("--no-binning-check", action="store_true")
    parser.add_argument("--no-gpu-tests", action="store_true")
    parser.add_argument("--binning-check", type=Path, help=argparse.SUPPRESS)  # the check's own process
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "build_gpu.json")
    args = parser.parse_args()
    if args.binning_check:
        try:
            print(json.dumps(binning_check(args.binning_check, args.input, args.check_samples)), flush=True)
        except Exception:
            print(json.dumps({"failed": traceback.format_exc()[-4000:]}), flush=True)
        return
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"machine": machine(), "import_seconds": import_seconds(), "rows": []}
    print(json.dumps(result["machine"]), f"imports {result['import_seconds']} s", flush=True)

    def save() -> None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")

    save()
    for round_ in range(1, args.rounds + 1):
        for precision in args.precisions.split(","):
            row = {"round": round_, **build(args.work, precision, args.samples, args.model_factory, args.input,
                                            args.buckets)}
            result["rows"].append(row)
            save()
            print(json.dumps({k: v for k, v in row.items() if k != "output_tail"}), flush=True)
            if "output_tail" in row:
                print(row["output_tail"], flush=True)
    if not args.no_binning_check and "int8" in args.precisions.split(","):
        result["binning_check"] = run_binning_check(args.work, args.input, args.check_samples)
        save()
        print(json.dumps(result["binning_check"]), flush=True)
    if not args.no_gpu_tests:
        result["gpu_tests"] = run_gpu_tests()
        save()
        print(json.dumps(result["gpu_tests"]), flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
