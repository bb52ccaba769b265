"""Time export, each graph pass and verification on the bundled CNN at a ResNet-50-like size (3x224x224).

Prints a table and writes JSON. Usage:
    python benchmarks/export_bench.py [--out benchmarks/results/export_bench.json] [--repeat 3]
"""

from __future__ import annotations

import argparse
import io
import json
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import onnx  # noqa: E402
import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from compiler.backends.onnxrt_runner import OnnxRuntimeRunner  # noqa: E402
from compiler.backends.pytorch import TorchRunner  # noqa: E402
from compiler.core.specs import ModelSpec, parse_input_spec  # noqa: E402
from compiler.frontend.export import onnx_from_torch  # noqa: E402
from compiler.frontend.loading import LoadedModel  # noqa: E402
from compiler.frontend.passes import DEFAULT_PASSES, run_passes_unchecked  # noqa: E402
from compiler.frontend.verify import Tolerance, verify_runners  # noqa: E402
from examples.models import resnet50_like  # noqa: E402


def main() -> None:
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "export_bench.json")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = resnet50_like()
    params = sum(p.numel() for p in model.parameters())
    spec = ModelSpec((parse_input_spec("images:Bx3x224x224"),))
    rows: dict[str, list[float]] = {}
    nodes: dict[str, str] = {}
    for _ in range(args.repeat):
        with tempfile.TemporaryDirectory() as tmp:
            result = onnx_from_torch(LoadedModel("factory", None, module=model), spec, max_batch=16, workdir=Path(tmp))
        rows.setdefault("export (dynamo)", []).append(result.seconds)
        folded, passes = run_passes_unchecked(result.model, DEFAULT_PASSES)
        for p in passes:
            rows.setdefault(f"pass {p.name}", []).append(p.seconds)
            nodes[f"pass {p.name}"] = f"{p.nodes_before} -> {p.nodes_after}"
        start = time.perf_counter()
        with OnnxRuntimeRunner(folded, ["CPUExecutionProvider"]) as candidate, TorchRunner(model, ["images"]) as ref:
            verify_runners(candidate, ref, spec, [1, 16], Tolerance(), "bench")
        rows.setdefault("verify (batch 1 and 16)", []).append(time.perf_counter() - start)
        # the TorchScript exporter with BatchNorm kept: what the folding pass costs when it has work to do
        start = time.perf_counter()
        buf = io.BytesIO()
        torch.onnx.export(model, (torch.randn(2, 3, 224, 224),), buf, dynamo=False, do_constant_folding=False,
                          training=torch.onnx.TrainingMode.PRESERVE, input_names=["images"],
                          dynamic_axes={"images": {0: "B"}})
        rows.setdefault("export (torchscript, BN kept)", []).append(time.perf_counter() - start)
        _, passes = run_passes_unchecked(onnx.load_from_string(buf.getvalue()), DEFAULT_PASSES)
        for p in passes:
            rows.setdefault(f"  ts: pass {p.name}", []).append(p.seconds)
            nodes[f"  ts: pass {p.name}"] = f"{p.nodes_before} -> {p.nodes_after}"
    table = Table("step", "median s", "min s", "nodes", title=f"export_bench: ResNet-50-like CNN, {params / 1e6:.1f} M "
                  f"params, 3x224x224, {args.repeat} runs")
    for step, times in rows.items():
        table.add_row(step, f"{statistics.median(times):.3f}", f"{min(times):.3f}", nodes.get(step, ""))
    Console().print(table)
    record = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpus": torch.get_num_threads(), "python": platform.python_version(),
                          "torch": torch.__version__},
              "model": {"name": "resnet50_like", "params": params, "input": "images:Bx3x224x224"},
              "repeat": args.repeat,
              "steps": {k: {"median_s": statistics.median(v), "min_s": min(v), "runs": v} for k, v in rows.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
