"""Time INT8 calibration's data collection on an FP32 export: histograms plus the FP16 remainder's max |x|.

``--mode two-pass`` runs them as two passes over the data (``collect_histograms`` then ``collect_max_abs``,
what ``trtc build --int8`` did before one pass); ``--mode one-pass`` runs ``collect_histograms`` with
``max_abs_names`` (one pass, both results). Random images (seed 0), batches of ``--batch``; each mode in its
own process for a clean peak RSS. Writes JSON with seconds per stage, peak RSS (VmHWM) and the results'
agreement when both modes ran in one call (``--mode both``).

Usage (dev CPU):
    python -m compiler.cli export --model-factory benchmarks.sized_models:vit_b16 --input images:Bx3x224x224 \
        --buckets 1,16 --out /tmp/vit
    python benchmarks/calibration_passes.py /tmp/vit/model.onnx --samples 32 --out /tmp/passes.json
On the H200 add ``--providers CUDAExecutionProvider,CPUExecutionProvider --samples 512``, and
``--sweep-budgets 256,1024`` to time the one pass at larger exposed-tensor budgets too (what a budget buys
where the activations live on the device but the exposed tensors still come to the host: fewer runs,
more host memory; each row has its peak RSS and whether its amax match the default budget's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _peak_rss_gib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / (1 << 20)
    return 0.0


def run_mode(model_path: str, mode: str, samples: int, batch: int, providers: list[str], budget: int) -> dict[str, Any]:
    import numpy as np
    import onnx

    from calibration.calibrate import _float_tensors
    from calibration.qdq import QdqPolicy, tensors_to_calibrate
    from calibration.statistics import collect_histograms, collect_max_abs

    model = onnx.load(model_path, load_external_data=False)
    tensors = tensors_to_calibrate(model, QdqPolicy())
    floats = _float_tensors(model)
    name = model.graph.input[0].name
    shape = [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim][1:]

    def batches() -> Any:
        rng = np.random.default_rng(0)
        for start in range(0, samples, batch):
            yield {name: rng.standard_normal((min(batch, samples - start), *shape)).astype(np.float32)}

    out: dict[str, Any] = {"mode": mode, "tensors": len(tensors), "float_tensors": len(floats)}
    start, cpu = time.perf_counter(), time.process_time()
    max_abs: dict[str, float] | None
    if mode == "two-pass":
        stats = collect_histograms(model_path, tensors, batches(), providers=providers, budget_bytes=budget)
        out["histogram_seconds"] = round(time.perf_counter() - start, 2)
        mid = time.perf_counter()
        max_abs = collect_max_abs(model_path, floats, batches(), providers=providers, budget_bytes=budget)
        out["max_abs_seconds"] = round(time.perf_counter() - mid, 2)
    else:
        stats = collect_histograms(model_path, tensors, batches(), providers=providers, budget_bytes=budget,
                                   max_abs_names=floats)
        max_abs = stats.max_abs
    out["seconds"] = round(time.perf_counter() - start, 2)
    out["cpu_seconds"] = round(time.process_time() - cpu, 2)  # all threads: less noisy than wall on a shared host
    out["peak_rss_gib"] = round(_peak_rss_gib(), 3)
    out["amax"] = stats.amax("percentile", 99.99)
    out["max_abs"] = max_abs
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--mode", choices=["two-pass", "one-pass", "both"], default="both")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--providers", default="CPUExecutionProvider")
    parser.add_argument("--budget-mib", type=int, default=64)
    parser.add_argument("--sweep-budgets", default="", help="MiB,MiB,...: one-pass runs at these budgets too")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    providers = args.providers.split(",")
    if args.mode != "both":
        result = run_mode(args.model, args.mode, args.samples, args.batch, providers, args.budget_mib << 20)
        args.out.write_text(json.dumps(result, indent=1))
        return
    def fresh(mode: str, budget_mib: int) -> dict[str, Any]:
        part = args.out.with_suffix(f".{mode}.{budget_mib}.json")
        subprocess.run([sys.executable, __file__, args.model, "--mode", mode, "--samples", str(args.samples),
                        "--batch", str(args.batch), "--providers", args.providers, "--budget-mib",
                        str(budget_mib), "--out", str(part)], check=True)
        result: dict[str, Any] = json.loads(part.read_text())
        return result

    results = {mode: fresh(mode, args.budget_mib) for mode in ("two-pass", "one-pass")}
    two, one = results["two-pass"], results["one-pass"]
    summary = {
        "samples": args.samples, "providers": providers, "budget_mib": args.budget_mib,
        **{f"{m}_{k}": results[m][k] for m in results for k in ("seconds", "cpu_seconds", "peak_rss_gib")},
        "two-pass_histogram_seconds": two["histogram_seconds"], "two-pass_max_abs_seconds": two["max_abs_seconds"],
        "amax_identical": two["amax"] == one["amax"],
        "max_abs_max_rel_diff": max(abs(two["max_abs"][k] - one["max_abs"][k]) / max(abs(two["max_abs"][k]), 1e-30)
                                    for k in two["max_abs"]),
        "max_abs_same_keys": set(two["max_abs"]) == set(one["max_abs"]),
        "sweep": [],
    }
    for budget in (int(b) for b in args.sweep_budgets.split(",") if b):
        run = fresh("one-pass", budget)
        timing = {k: run[k] for k in ("seconds", "cpu_seconds", "peak_rss_gib")}
        summary["sweep"].append({"budget_mib": budget, **timing, "amax_identical": run["amax"] == one["amax"],
                                 # a histogram's bins follow the first run's max: other slices, other bins
                                 "amax_max_rel_diff": max(abs(run["amax"][k] - v) / v for k, v in one["amax"].items()),
                                 "max_abs_identical": run["max_abs"] == one["max_abs"]})
    args.out.write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
