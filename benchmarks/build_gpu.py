"""End-to-end `trtc build` time of a ViT-B/16-sized model on a GPU machine, INT8 and FP16, 512 samples each.

For each precision it runs, in a fresh process and a fresh output directory,

    trtc build --model-factory benchmarks.sized_models:vit_b16 --input images:Bx3x224x224 --buckets 1,8
        --int8|--fp16 --calib-data random --calib-samples 512 --engine none --out WORK/vit-PRECISION

and records the wall time, the stage times the build writes (export, calibration, gate), and the ONNX Runtime
provider that calibration, the FP16 range pass and the accuracy gate ran on (CUDAExecutionProvider where
onnxruntime-gpu sees a CUDA device). Random weights and random data: this measures time, not accuracy.
Target from the issue: each build under 60 s on an H200.

Usage (from the repository root, on the GPU machine):
    python benchmarks/build_gpu.py --out benchmarks/results/build_gpu.json [--work /tmp/trtc-build-gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def build(work: Path, precision: str, samples: int) -> dict[str, Any]:
    out = work / f"vit-{precision}"
    if out.exists():
        shutil.rmtree(out)
    cmd = [sys.executable, "-m", "compiler.cli", "build", "--model-factory", "benchmarks.sized_models:vit_b16",
           "--input", "images:Bx3x224x224", "--buckets", "1,8", f"--{precision}", "--calib-data", "random",
           "--calib-samples", str(samples), "--engine", "none", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    row: dict[str, Any] = {"precision": precision, "samples": samples, "seconds": round(seconds, 1),
                           "exit_code": proc.returncode, "command": " ".join(cmd[1:])}
    if proc.returncode:
        row["output_tail"] = (proc.stdout + proc.stderr)[-3000:]
        return row
    manifest = json.loads((out / "manifest.json").read_text())
    accuracy = json.loads((out / "report" / "accuracy.json").read_text())[precision]
    row.update({"export_seconds": manifest.get("export", {}).get("seconds"),
                "calibration_and_gate_seconds": accuracy.get("seconds"),
                "gate_provider": (accuracy.get("accuracy") or {}).get("provider"),
                "gate_summary": manifest.get("accuracy", {}).get(precision, {}).get("summary"),
                "calibration_provider": manifest.get("calibration", {}).get("provider"),
                "fp16_range_provider": manifest.get("fp16", {}).get("range_provider"),
                "target_met": seconds < 60})
    return row


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
    from compiler.core.onnx_io import checking_providers

    info["checking_providers"] = checking_providers()
    return info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path("/tmp/trtc-build-gpu"))
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--precisions", default="int8,fp16")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "build_gpu.json")
    args = parser.parse_args()
    rows = []
    for precision in args.precisions.split(","):
        row = build(args.work, precision, args.samples)
        rows.append(row)
        print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
