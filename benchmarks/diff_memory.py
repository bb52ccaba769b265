"""Peak memory of `trtc diff` on a ViT-B/16-sized model, beside `trtc calibrate` of the same model.

A ViT-B/16 from ``transformers.ViTConfig`` (its defaults: patch 16, 12 layers, width 768, 12 heads, MLP 3072,
224x224 images; random weights, 86 M parameters) is exported, then calibrated INT8 on a few random images
(``--engine none``, ``--max-fallback 0``), then compared layer by layer with ``trtc diff``. Each command runs in
a fresh process; its peak RSS is the largest sum of the RSS of the command and its children, sampled every 20 ms
with psutil. The table also gives the bytes of the compared tensors per sample, which a diff holding them outside
ONNX Runtime would need for one sample, against the calibration budget (``CALIB_MEMORY_BUDGET``).

Usage:
    python benchmarks/diff_memory.py [--samples 8] [--diff-samples 1,4,8] [--work /tmp/trtc-diff-mem]
        [--out benchmarks/results/diff_memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIB = 1 << 20
INPUT = "pixel_values:Bx3x224x224"


class ViTLogits(torch.nn.Module):
    """transformers' ViT image classifier, returning the logits tensor alone (the export wants tensors)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ViTConfig, ViTForImageClassification

        torch.manual_seed(0)
        self.model = ViTForImageClassification(ViTConfig(num_labels=1000, attn_implementation="eager")).eval()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


def vit_b16() -> torch.nn.Module:
    """ViT-B/16 (``transformers.ViTConfig()`` defaults), random weights: the model factory of this benchmark."""
    return ViTLogits().eval()


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def peak_rss(args: list[str]) -> tuple[float, float, str]:
    """Run ``trtc ARGS``: (peak RSS of it and its children in MiB, seconds, its output)."""
    command = [sys.executable, "-m", "compiler.cli", *args]
    start = time.perf_counter()
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env(), text=True)
    watched = psutil.Process(proc.pid)
    peak = 0
    while proc.poll() is None:
        try:
            total = watched.memory_info().rss + sum(c.memory_info().rss for c in watched.children(recursive=True))
            peak = max(peak, total)
        except psutil.Error:
            pass
        time.sleep(0.02)
    output = proc.stdout.read() if proc.stdout else ""
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}:\n{output[-3000:]}")
    return peak / MIB, time.perf_counter() - start, output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=8, help="samples calibrated (and the gate's)")
    parser.add_argument("--diff-samples", type=lambda t: [int(v) for v in t.split(",")], default=[1, 4, 8],
                        help="the diffs' sample counts, comma-separated: peak RSS flat in them")
    parser.add_argument("--work", type=Path, default=Path("/tmp/trtc-diff-mem"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "diff_memory.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    images = np.random.default_rng(0).standard_normal((args.samples, 3, 224, 224)).astype(np.float32)
    data = args.work / "images.npz"
    np.savez(data, pixel_values=images)
    out = args.work / "vit"
    rows: list[dict[str, Any]] = []
    if not (out / "manifest.json").is_file():
        peak, seconds, _ = peak_rss(["export", "--model-factory", "benchmarks.diff_memory:vit_b16", "--input", INPUT,
                                     "--buckets", "1,4", "--out", str(out), "-q"])
        rows.append({"command": "trtc export", "peak_rss_mib": round(peak), "seconds": round(seconds, 1)})
    peak, seconds, _ = peak_rss(["calibrate", str(out), "--int8", "--calib-data", str(data), "--eval-data", str(data),
                                 "--calib-batch", "2", "--max-fallback", "0", "-q"])
    rows.append({"command": f"trtc calibrate --int8 ({args.samples} samples)", "peak_rss_mib": round(peak),
                 "seconds": round(seconds, 1)})
    for samples in args.diff_samples:
        peak, seconds, _ = peak_rss(["diff", str(out), "--samples", str(samples), "--no-plot"])
        rows.append({"command": f"trtc diff ({samples} samples)", "peak_rss_mib": round(peak),
                     "seconds": round(seconds, 1)})
    report = json.loads((out / "report" / "diff.json").read_text())
    from compiler.core import defaults
    from compiler.core.manifest import read_manifest
    from compiler.core.onnx_io import load_onnx

    manifest = read_manifest(out)
    fp32 = load_onnx(manifest.onnx_for(out, "fp32"), load_weights=False)
    compared = {row["layer"] for row in report["layers"]}
    per_sample = 0
    typed = __import__("onnx").shape_inference.infer_shapes(fp32)
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim][1:]
              for vi in [*typed.graph.value_info, *typed.graph.output]}
    for node in fp32.graph.node:
        if node.name in compared and node.output[0] in shapes and all(shapes[node.output[0]]):
            per_sample += 4 * int(np.prod(shapes[node.output[0]]))
    result = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
        "model": "ViT-B/16 (transformers.ViTConfig defaults, random weights)",
        "fp32_onnx_mib": round((manifest.onnx["fp32"].bytes or 0) / MIB),
        "int8_onnx_mib": round((manifest.onnx["int8"].bytes or 0) / MIB),
        "layers_compared": len(report["layers"]), "samples": report["samples"], "provider": report["provider"],
        "compared_tensor_mib_per_sample": round(3 * per_sample / MIB, 1),  # reference, candidate, isolated copy
        "calib_memory_budget_mib": defaults.CALIB_MEMORY_BUDGET // MIB,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    table = ["| command | peak RSS | seconds |", "| --- | --- | --- |"]
    table += [f"| {r['command']} | {r['peak_rss_mib']} MiB | {r['seconds']} |" for r in rows]
    text = "\n".join(table) + (f"\n\n{result['layers_compared']} layers compared; their tensors would take "
                               f"{result['compared_tensor_mib_per_sample']} MiB a sample outside ONNX Runtime "
                               f"(calibration budget {result['calib_memory_budget_mib']} MiB)\n")
    args.out.with_suffix(".md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
