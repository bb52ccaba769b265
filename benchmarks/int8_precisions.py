"""INT8 with an FP16 rest vs INT8 with an FP32 rest vs FP16, on a CNN and a MiniLM-like transformer.

Models (no downloads): the bundled digits ResNet (examples.models.resnet_digits) trained 5 epochs on
scikit-learn's digits, gated on top-1 against its labels; and examples.minilm.minilm_like (BertModel with
all-MiniLM-L6-v2's config, random weights, a few FFN output channels scaled to imitate real outlier
channels), calibrated on 96 padded random-token sentences and gated on cosine of the token embeddings.
For each model and variant it runs ``trtc calibrate`` (the code users call) on a copy of the FP32 export
and records: the gate's metric, the file size of the reduced ONNX (graph + weights), the INT8/FP16/FP32
node counts from report/accuracy.json, and the calibration time against the gate's time. A last row per
model forces the fallback search (``--max-fallback 2`` with a floor the model cannot reach) to time the
one-pass layer ranking against calibration.

Usage:
    python benchmarks/int8_precisions.py [--models cnn,minilm] [--out benchmarks/results/int8_precisions.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS: dict[str, list[str]] = {
    "int8 (fp16 rest)": ["--int8"],
    "int8 --fp32-rest": ["--int8", "--fp32-rest"],
    "fp16": ["--fp16"],
}


def _prepare_cnn(work: Path) -> dict[str, Any]:
    import torch

    from compiler.core.settings import ExportSettings, ModelSource
    from compiler.core.specs import ModelSpec, parse_input_spec
    from compiler.pipeline.export import export_directory
    from examples.digits import train_digits

    torch.set_num_threads(1)
    model, splits = train_digits(epochs=5)
    torch.save(model.state_dict(), work / "weights.pt")
    np.savez(work / "calib.npz", images=splits.calib_x)
    np.savez(work / "eval.npz", images=splits.test_x, labels=splits.test_y)
    export_directory(ExportSettings(ModelSource(factory="examples.models:resnet_digits", weights=work / "weights.pt"),
                                    work / "fp32", spec=ModelSpec((parse_input_spec("images:Bx1x8x8"),)),
                                    buckets=(1, 16)))
    return {"fp32": work / "fp32", "calib": work / "calib.npz", "eval": work / "eval.npz",
            "force_fallback": ["--max-accuracy-drop", "-1"]}


def _prepare_minilm(work: Path) -> dict[str, Any]:
    import torch

    from compiler.core.settings import ExportSettings, ModelSource
    from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec
    from compiler.pipeline.export import export_directory
    from examples.minilm import minilm_like, token_batches

    torch.save(minilm_like().state_dict(), work / "weights.pt")
    for name, seed in (("calib", 1), ("eval", 2)):
        (work / name).mkdir()
        for i, batch in enumerate(token_batches(seed, 12)):
            np.savez(work / name / f"{i:03d}.npz", **batch)
    spec = ModelSpec((parse_input_spec("input_ids:BxS:int64"), parse_input_spec("attention_mask:BxS:int64")),
                     dict([parse_dim_range("S=1:48:128")]))
    export_directory(ExportSettings(ModelSource(factory="examples.minilm:minilm_like", weights=work / "weights.pt"),
                                    work / "fp32", spec=spec, buckets=(1, 8)))
    return {"fp32": work / "fp32", "calib": work / "calib", "eval": work / "eval",
            "force_fallback": ["--min-cosine", "0.9999999"]}


def _run(model: dict[str, Any], work: Path, name: str, args: list[str]) -> dict[str, Any]:
    directory = work / name.replace(" ", "_").replace("(", "").replace(")", "")
    shutil.copytree(model["fp32"], directory)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "compiler.cli", "calibrate", str(directory), "-q", *args,
                           "--calib-data", str(model["calib"]), "--eval-data", str(model["eval"])],
                          capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - start
    precision = "int8" if "--int8" in args else "fp16"
    report = json.loads((directory / "report" / "accuracy.json").read_text())[precision]
    calibration = json.loads((directory / "calibration.json").read_text()) if precision == "int8" else {}
    onnx_file = directory / f"model.{precision}.onnx"
    size = sum(p.stat().st_size for p in (onnx_file, Path(f"{onnx_file}.data")) if p.is_file())
    fp16 = report.get("fp16", {})
    counts = report.get("node_precisions", {}).get("counts") or {
        "int8": 0, "fp16": fp16.get("fp16_nodes", 0), "fp32": len(fp16.get("fp32_nodes", {}))}
    return {"variant": name, "args": args, "exit_code": proc.returncode, "accuracy": report["accuracy"],
            "kept": list(report.get("kept_in_fp32", {})), "bytes": size if onnx_file.is_file() else None,
            "fp32_bytes": sum(p.stat().st_size for p in model["fp32"].glob("model.onnx*")),
            "nodes": counts, "seconds_total": round(wall, 2), "seconds_in_calibrate": report["seconds"],
            "calibration_seconds": calibration.get("seconds"), "gate_seconds": report.get("gate_seconds"),
            "ranking_seconds": report.get("ranking_seconds"),
            "gate_steps": len(report.get("gate_history", []))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cnn,minilm")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "int8_precisions.json")
    args = parser.parse_args()
    import onnxruntime
    import torch

    results: dict[str, Any] = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                           "python": platform.python_version(), "torch": torch.__version__,
                                           "onnxruntime": onnxruntime.__version__},
                               "command": " ".join([Path(sys.executable).name, *sys.argv]), "models": {}}
    prepare = {"cnn": _prepare_cnn, "minilm": _prepare_minilm}
    with tempfile.TemporaryDirectory(prefix="trtc-int8-bench-") as tmp:
        for name in args.models.split(","):
            work = Path(tmp) / name
            work.mkdir()
            model = prepare[name](work)
            rows = [_run(model, work, variant, flags) for variant, flags in VARIANTS.items()]
            rows.append(_run(model, work, "int8, fallback forced (2 layers)",
                             ["--int8", "--max-fallback", "2", *model["force_fallback"]]))
            results["models"][name] = rows
            for row in rows:
                acc = row["accuracy"]
                metric = (f"top-1 drop {acc['drop_points']:.2f} pt" if acc["metric"] == "top1"
                          else f"cosine {acc['cosine_mean']:.5f}")
                print(f"{name:7s} {row['variant']:32s} exit {row['exit_code']} {metric:22s} "
                      f"{(row['bytes'] or 0) / 1e6:7.2f} MB  nodes {row['nodes']}  calib {row['calibration_seconds']} s"
                      f"  gate {row['gate_seconds']} s (ranking {row['ranking_seconds']} s)", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
