"""A model with more than 2 GiB of FP32 weights through `trtc build --int8` and `--fp16`, with its peak memory.

Protobuf cannot serialize a message over 2 GiB, so every step must keep the weights in external data
(``model.onnx.data``). The model is an MLP of ``--layers`` Linear(4096, 4096) + ReLU layers (36 by default:
2.25 GiB of FP32 weights) plus a 10-way head, random weights. Two sources:

* ``--source onnx`` (default): the FP32 ONNX is written with onnx.helper, then ``trtc build model.onnx``
  (export skipped; the passes, verification against the original ONNX, calibration and the gate run);
* ``--source torch``: ``trtc build --model-factory benchmarks.sized_models:big_mlp`` (the dynamo export too).

Each build runs with ``--calib-data random --calib-samples 64 --buckets 1,4 --engine none --max-fallback 0``
in a fresh process; the peak RSS is the largest sum over the process tree, sampled every 20 ms (and, in
``peak_parts_gib``, the peaks of the build process and of its calibration worker apart). The target of the
issue: peak <= 2 x the FP32 model's size + 1.5 GiB.

Usage:
    python benchmarks/big_model.py [--source onnx|torch] [--precisions int8,fp16] [--work /tmp/trtc-big]
        [--out benchmarks/results/big_model.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.calibration_memory import GIB, peak_rss, trtc  # noqa: E402

WIDTH = 4096


def write_onnx(path: Path, layers: int) -> int:
    """The MLP as ONNX with external data; returns the bytes of its weights."""
    from onnx import TensorProto, helper, numpy_helper

    from compiler.core.onnx_io import save_onnx

    rng = np.random.default_rng(0)
    nodes, inits, last = [], [], "x"
    for i in range(layers):
        w = (rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) * WIDTH ** -0.5)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(np.zeros(WIDTH, np.float32), f"b{i}")]
        nodes += [helper.make_node("Gemm", [last, f"w{i}", f"b{i}"], [f"g{i}"], name=f"fc{i}"),
                  helper.make_node("Relu", [f"g{i}"], [f"r{i}"], name=f"relu{i}")]
        last = f"r{i}"
    inits += [numpy_helper.from_array(rng.standard_normal((WIDTH, 10), dtype=np.float32) * WIDTH ** -0.5, "wh")]
    nodes.append(helper.make_node("MatMul", [last, "wh"], ["logits"], name="head"))
    graph = helper.make_graph(nodes, "big_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", WIDTH])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["B", 10])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    save_onnx(model, path)
    del model, inits
    return sum(p.stat().st_size for p in path.parent.glob(path.name + "*"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", choices=["onnx", "torch"], default="onnx")
    parser.add_argument("--layers", type=int, default=36)
    parser.add_argument("--precisions", default="int8,fp16")
    parser.add_argument("--work", type=Path, default=Path("/tmp/trtc-big"))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "big_model.json")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    source = args.work / "src" / "model.onnx"
    if args.source == "onnx":
        if not source.is_file():
            source.parent.mkdir(parents=True, exist_ok=True)
            write_onnx(source, args.layers)
        size = sum(p.stat().st_size for p in source.parent.glob("model.onnx*"))
        model_args = [str(source), "--input", "x:Bx4096"]
    else:
        size = 4 * (args.layers * (WIDTH * WIDTH + WIDTH) + WIDTH * 10 + 10)
        model_args = ["--model-factory", "benchmarks.sized_models:big_mlp", "--input", "x:Bx4096"]
    rows: list[dict[str, Any]] = []
    for precision in args.precisions.split(","):
        out = args.work / f"build-{args.source}-{precision}"
        if out.exists():
            shutil.rmtree(out)
        cmd = trtc("build", *model_args, f"--{precision}", "--buckets", "1,4", "--calib-data", "random",
                   "--calib-samples", "64", "--max-fallback", "0", "--engine", "none", "--out", str(out), "-q")
        parts: dict[str, int] = {}
        peak, seconds, code, output = peak_rss(cmd, parts)
        target = 2 * size + 1.5 * GIB
        files = {p.name: p.stat().st_size for p in out.glob("model*.onnx*")} if out.is_dir() else {}
        row = {"source": args.source, "precision": precision, "model_gib": round(size / GIB, 3),
               "peak_rss_gib": round(peak / GIB, 3), "target_gib": round(target / GIB, 3),
               "peak_parts_gib": {k: round(v / GIB, 3) for k, v in parts.items()},
               "within_target": code == 0 and peak <= target, "seconds": round(seconds, 1), "exit_code": code,
               "files": files,
               "output_tail": output if code else ""}
        rows.append(row)
        print(json.dumps(row), flush=True)
    machine = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine, "command": " ".join(sys.argv), "rows": rows}, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
