"""Peak memory of `trtc calibrate` per model and precision: is it bounded, and flat in the sample count?

Each case runs ``trtc calibrate DIR --int8|--fp16 --calib-data random --calib-samples N`` (default
``--calib-batch`` 16, the gate on the same samples, ``--max-fallback 0`` so that a gate miss does not start
the per-layer search) in a fresh process on a fresh copy of an FP32 export. The peak RSS is the largest sum
of the RSS of the command and its worker process, sampled every 20 ms with psutil. The target of the
issue: peak <= 2 x the FP32 model's size + 1.5 GiB, and ResNet-50 INT8 at defaults <= 1.5 GiB, flat in N.

Models (benchmarks/sized_models.py, random weights): ResNet-50 at 224x224, ViT-B/16, GPT-2 small at 128 tokens.
The transformers run few samples by default (32): on a 2-core machine each pass over ViT-B/16 takes ~1 s a
sample; memory does not depend on N past one batch (that is what the ResNet-50 rows at 64 and 256 check).

Usage:
    python benchmarks/calibration_memory.py [--cases resnet50-int8-64,...] [--work /tmp/trtc-calib-mem]
        [--out benchmarks/results/calibration_memory.json]
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

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.sized_models import INPUTS  # noqa: E402

GIB = 1 << 30
# name-precision-samples
DEFAULT_CASES = ("resnet50-int8-64", "resnet50-int8-256", "vit_b16-int8-32", "vit_b16-fp16-32",
                 "gpt2_small-int8-32", "gpt2_small-fp16-32")


def trtc(*args: str) -> list[str]:
    return [sys.executable, "-m", "compiler.cli", *args]


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def exported(work: Path, model: str) -> Path:
    """An FP32 export of the model (made once, reused)."""
    out = work / "exports" / model
    if (out / "manifest.json").is_file():
        return out
    args = ["export", "--model-factory", f"benchmarks.sized_models:{model}", "--buckets", "1,16", "--out", str(out),
            "-q"]
    for spec in INPUTS[model]:
        args += ["--input", spec]
    subprocess.run(trtc(*args), check=True, env=env(), cwd=ROOT)
    return out


def model_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("model.onnx*"))


def peak_rss(cmd: list[str], parts: dict[str, int] | None = None) -> tuple[int, float, int, str]:
    """(peak RSS of the process tree in bytes, seconds, exit code, output tail).

    ``parts``, when given, receives the peak of the command's own process (``"command"``) and of its
    workers together (``"workers"``): where the tree's peak comes from.
    """
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    top = psutil.Process(proc.pid)
    peak = own = workers = 0
    while proc.poll() is None:
        try:
            mine = top.memory_info().rss
            theirs = sum(p.memory_info().rss for p in top.children(recursive=True) if p.is_running())
            peak, own, workers = max(peak, mine + theirs), max(own, mine), max(workers, theirs)
        except psutil.Error:
            pass
        time.sleep(0.02)
    output = proc.stdout.read() if proc.stdout else ""
    if parts is not None:
        parts.update(command=own, workers=workers)
    return peak, time.perf_counter() - start, proc.returncode, output[-2000:]


def run_case(work: Path, case: str) -> dict[str, Any]:
    model, precision, samples = case.rsplit("-", 2)
    source = exported(work, model)
    directory = work / "runs" / case
    if directory.exists():
        shutil.rmtree(directory)
    shutil.copytree(source, directory)
    size = model_bytes(source)
    cmd = trtc("calibrate", str(directory), f"--{precision}", "--calib-data", "random", "--calib-samples", samples,
               "--max-fallback", "0", "-q")
    parts: dict[str, int] = {}
    peak, seconds, code, output = peak_rss(cmd, parts)
    target = 1.5 * GIB if model == "resnet50" and precision == "int8" else 2 * size + 1.5 * GIB
    accuracy = {}
    report = directory / "report" / "accuracy.json"
    if report.is_file():
        accuracy = (json.loads(report.read_text()).get(precision) or {}).get("accuracy") or {}
    return {"case": case, "model": model, "precision": precision, "samples": int(samples),
            "model_gib": round(size / GIB, 3), "peak_rss_gib": round(peak / GIB, 3),
            "peak_parts_gib": {k: round(v / GIB, 3) for k, v in parts.items()},
            "target_gib": round(target / GIB, 3),
            "within_target": code == 0 and peak <= target, "seconds": round(seconds, 1), "exit_code": code,
            "gate": {k: accuracy.get(k) for k in ("passed", "cosine_mean", "worst_output", "provider",
                                                   "fp16_emulated")},
            "output_tail": output if code else ""}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(DEFAULT_CASES))
    parser.add_argument("--work", type=Path, default=Path("/tmp/trtc-calib-mem"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "calibration_memory.json")
    args = parser.parse_args()
    rows = []
    for case in args.cases.split(","):
        row = run_case(args.work, case)
        rows.append(row)
        print(f"{row['case']:<22} model {row['model_gib']:.2f} GiB  peak {row['peak_rss_gib']:.2f} GiB "
              f"target {row['target_gib']:.2f}  "
              f"{'ok' if row['within_target'] else 'OVER'}  {row['seconds']:.0f} s  exit {row['exit_code']}  "
              f"gate {row['gate']}", flush=True)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(),
               "memory_gib": round(psutil.virtual_memory().total / GIB, 1), "python": platform.python_version()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "command": " ".join(sys.argv), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
