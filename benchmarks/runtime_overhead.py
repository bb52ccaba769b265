"""What ``engines(x)`` adds to the bare backend call, per call, on the CPU (ONNX Runtime, small MLP).

The bare call is ONNX Runtime's ``run_with_iobinding`` on the very buffers and binding the runtime
uses for that bucket; ``engines(x)`` adds the feed check, routing, the context pool, the copy into
the bucket's buffer and the copy of the real rows out. Both are timed in alternating rounds (the
machine's noise hits both alike); the table gives the median and the best round, per call.
Target: under 30 µs added per call.

    python benchmarks/runtime_overhead.py                  # writes benchmarks/results/runtime_overhead.json
    python benchmarks/runtime_overhead.py --dir build/m --batches 1,8 --out /tmp/overhead.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

TARGET_US = 30.0


def mlp_directory(out: Path) -> Path:
    """examples.models:mlp as a build directory (TorchScript export: a second, no verification)."""
    import torch

    from compiler.core.manifest import FileRecord, Manifest, SourceRecord, write_manifest
    from compiler.core.onnx_io import load_onnx, save_onnx
    from examples import models

    out.mkdir(parents=True, exist_ok=True)
    torch.onnx.export(models.mlp(), (torch.randn(2, 64),), str(out / "raw.onnx"), dynamo=False, input_names=["x"],
                      output_names=["logits"], dynamic_axes={"x": {0: "B"}, "logits": {0: "B"}}, opset_version=17)
    save_onnx(load_onnx(out / "raw.onnx"), out / "model.onnx")
    (out / "raw.onnx").unlink()
    write_manifest(out / "manifest.json", Manifest(
        inputs=("x:Bx64:float32",), output_names=("logits",), buckets=(1, 4, 8, 16),
        source=SourceRecord("examples.models:mlp", "factory"),
        onnx={"fp32": FileRecord.for_onnx(out, out / "model.onnx")}, precision="fp32"))
    return out


def per_call_us(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - start) / calls / 1000.0


def measure(engines: Any, batch: int, rounds: int, calls: int, as_torch: bool) -> dict[str, Any]:
    x = np.random.default_rng(batch).standard_normal((batch, 64)).astype(np.float32)
    feed: Any = x
    if as_torch:
        import torch

        feed = torch.from_numpy(x)
    context = engines._acquire()
    engines._release(context)
    checked = engines.check(x)
    bucket = engines._route[batch]
    context.run(bucket, checked, 0, batch, True)  # stage once: the bare call reads these buffers
    binding = context._binding(bucket, checked).binding
    session = engines._backend.session

    def bare() -> None:
        session.run_with_iobinding(binding)

    def full() -> None:
        engines(feed)

    for fn in (bare, full):
        per_call_us(fn, calls)  # warm-up
    bare_times, full_times = [], []
    for _ in range(rounds):
        bare_times.append(per_call_us(bare, calls))
        full_times.append(per_call_us(full, calls))
    added = [f - b for f, b in zip(full_times, bare_times)]
    return {"batch": batch, "bucket": bucket, "input": "torch" if as_torch else "numpy",
            "bare_us": {"median": statistics.median(bare_times), "best": min(bare_times)},
            "engines_us": {"median": statistics.median(full_times), "best": min(full_times)},
            "added_us": {"median": statistics.median(added), "best_rounds": min(full_times) - min(bare_times)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="A build directory (default: examples.models:mlp, built here).")
    parser.add_argument("--batches", default="1,3,16", help="Batch sizes to time (default 1,3,16).")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--calls", type=int, default=2000, help="Calls per round.")
    parser.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads (default 1).")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "runtime_overhead.json",
                        help="The JSON to write (default benchmarks/results/runtime_overhead.json).")
    args = parser.parse_args()

    import onnxruntime
    from rich.console import Console
    from rich.table import Table

    from compiler.serve.load import load

    with tempfile.TemporaryDirectory() as tmp:
        directory = args.dir or mlp_directory(Path(tmp) / "mlp")
        with load(directory, backend="onnxruntime", device="cpu", threads=args.threads, contexts=1) as engines:
            rows = [measure(engines, int(b), args.rounds, args.calls, as_torch)
                    for b in args.batches.split(",") for as_torch in (False, True)]
    table = Table(title=f"engines(x) vs the bare ONNX Runtime call, µs per call (median of {args.rounds} rounds; "
                        "best round)")
    for column in ("batch", "bucket", "input", "bare", "engines(x)", "added"):
        table.add_column(column, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), str(r["bucket"]), r["input"],
                      f"{r['bare_us']['median']:.1f} ({r['bare_us']['best']:.1f})",
                      f"{r['engines_us']['median']:.1f} ({r['engines_us']['best']:.1f})",
                      f"{r['added_us']['median']:.1f} ({r['added_us']['best_rounds']:.1f})")
    console = Console()
    console.print(table)
    worst = max(r["added_us"]["median"] for r in rows if r["input"] == "numpy")
    worst_torch = max(r["added_us"]["median"] for r in rows if r["input"] == "torch")
    verdict = "meets" if worst < TARGET_US else "misses"
    console.print(f"numpy inputs: at most {worst:.1f} µs added per call ({verdict} the {TARGET_US:.0f} µs target); "
                  f"CPU torch tensors: at most {worst_torch:.1f} µs (a tensor->numpy view in, numpy->tensor out)")
    report = {"benchmark": "runtime_overhead", "command": " ".join(["benchmarks/runtime_overhead.py", *sys.argv[1:]]),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "onnxruntime": onnxruntime.__version__},
              "target_us": TARGET_US, "max_added_us": worst,
              "max_added_us_torch": worst_torch, "meets_target": worst < TARGET_US, "threads": args.threads,
              "rows": rows}
    print(json.dumps(report, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
