"""Does ``engines.map`` overlap copies, compute and post-processing? (CUDA GPU, the runtime's torch backend)

The model is built in-process (``examples.models``, no export) and served with
``engines_from_module(..., device="cuda")``: pinned host buffers, one CUDA stream and one CUDA graph
per bucket in each of the two buffer sets. Per batch of host (numpy) inputs there are three stages:

* copy: stage the batch into pinned memory, copy it to the GPU and the outputs back (timed alone);
* compute: the model (a CUDA graph replay, timed alone with CUDA events);
* post-process: CPU work on the outputs, softmax and top-5 plus a synthetic numpy workload sized
  to ``--post-fraction`` of the compute time, so that the three stages are comparable.

A sequential loop (``post(engines(x))`` per batch) takes about the sum of the stages; with double
buffering ``map`` can at best take the largest stage per batch. The benchmark passes when ``map``
reaches ``--target`` (0.9) of that bound: bound time / map time per batch >= 0.9.

    python benchmarks/runtime_map_gpu.py --out build/bench-map
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def wall(fn: Callable[[], Any], repeat: int) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=128, help="Rows per batch (default 128).")
    parser.add_argument("--size", type=int, default=64, help="Image height and width (default 64).")
    parser.add_argument("--steps", type=int, default=150, help="Batches per timed run (default 150).")
    parser.add_argument("--post-fraction", type=float, default=0.6,
                        help="Synthetic post-processing as a fraction of the compute time (default 0.6).")
    parser.add_argument("--depth", type=int, default=2, help="Buffer sets map uses (default 2: double buffering).")
    parser.add_argument("--target", type=float, default=0.9, help="Required fraction of the bound (default 0.9).")
    parser.add_argument("--out", type=Path, help="Write runtime_map_gpu.json here.")
    args = parser.parse_args()

    import torch
    from rich.console import Console
    from rich.table import Table

    from compiler.serve.load import engines_from_module
    from examples import models

    if not torch.cuda.is_available():
        sys.exit("runtime_map_gpu needs a CUDA GPU (torch.cuda.is_available() is False)")
    console = Console()
    started = time.perf_counter()
    engines = engines_from_module(models.resnet_cnn(), [f"images:Bx3x{args.size}x{args.size}"],
                                  buckets=[args.batch // 4, args.batch // 2, args.batch], device="cuda")
    rng = np.random.default_rng(0)
    batches = [rng.standard_normal((args.batch, 3, args.size, args.size)).astype(np.float32) for _ in range(8)]
    feed = [batches[i % len(batches)] for i in range(args.steps)]

    # -- each stage alone --
    context: Any = engines._acquire()  # a CUDA context of the torch backend: its buffers and stream
    engines._release(context)
    call = engines.check(batches[0])
    bucket = engines._route[args.batch]

    device_view, host_view, host_np = context._input_views(bucket, call)["images"]
    outputs = context._graphs[bucket][1]

    def stage_only() -> None:  # into pinned memory, as run() does
        context.stage(host_np, host_view, batches[0])

    def transfers_only() -> None:
        with torch.cuda.stream(context.stream):
            device_view.copy_(host_view, non_blocking=True)
            for out in outputs.values():
                context._pinned_output("o", out.numel(), out.dtype)[:out.numel()].view(out.shape).copy_(
                    out, non_blocking=True)
        context.stream.synchronize()

    def copy_only() -> None:  # what run() does besides compute: stage, H2D, D2H; then wait
        stage_only()
        transfers_only()

    def compute_only(reps: int = 20) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(context.stream):
            begin.record()
            for _ in range(reps):
                context.execute(bucket, call)
            end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000.0 / reps

    for _ in range(5):
        copy_only()
        compute_only(2)
    copy_s = wall(copy_only, 30)
    stage_s = wall(stage_only, 30)
    transfer_s = wall(transfers_only, 30)
    compute_s = statistics.median(compute_only() for _ in range(5))

    logits = engines(batches[0])
    work = np.random.default_rng(1).standard_normal(1 << 16).astype(np.float32)

    def synthetic(n: int) -> float:
        total = 0.0
        for _ in range(n):
            total += float(np.sort(work)[-1])
        return total

    per_sort = wall(lambda: synthetic(4), 10) / 4
    sorts = max(0, round(args.post_fraction * compute_s / per_sort))

    def postprocess(out: np.ndarray) -> tuple[np.ndarray, float]:
        z = out - out.max(axis=1, keepdims=True)
        probs = np.exp(z)
        probs /= probs.sum(axis=1, keepdims=True)
        top5 = np.argsort(-probs, axis=1)[:, :5]
        return top5, synthetic(sorts)

    post_s = wall(lambda: postprocess(logits), 20)
    bound_s = max(copy_s, compute_s, post_s)

    # -- sequential vs map, same work --
    def sequential() -> list[Any]:
        return [postprocess(engines(x)) for x in feed]

    def mapped() -> list[Any]:
        return list(engines.map(feed, postprocess=postprocess, depth=args.depth))

    check_seq = [r[0] for r in sequential()[:4]]
    check_map = [r[0] for r in mapped()[:4]]
    same = all(np.array_equal(a, b) for a, b in zip(check_seq, check_map))
    seq_s = min(wall(sequential, 1) for _ in range(3)) / args.steps
    map_s = min(wall(mapped, 1) for _ in range(3)) / args.steps
    engines.close()

    fraction = bound_s / map_s
    table = Table(title=f"map vs a sequential loop: batch {args.batch}x3x{args.size}x{args.size}, "
                        f"{torch.cuda.get_device_name(0)}, ms per batch")
    table.add_column("measure")
    table.add_column("ms", justify="right")
    for name, seconds in (("copy (stage + H2D + D2H)", copy_s), ("  stage into pinned memory", stage_s),
                          ("  H2D + D2H", transfer_s), ("compute (CUDA graph)", compute_s),
                          ("post-process (CPU)", post_s), ("sum of stages", copy_s + compute_s + post_s),
                          ("bound: largest stage", bound_s), ("sequential loop", seq_s), (f"map (depth {args.depth})",
                                                                                         map_s)):
        table.add_row(name, f"{seconds * 1000:.3f}")
    console.print(table)
    passed = fraction >= args.target and same
    console.print(f"map reaches {fraction:.1%} of the bound (target {args.target:.0%}), {seq_s / map_s:.2f}x the "
                  f"sequential loop; results identical: {same} -> {'PASS' if passed else 'FAIL'}")
    report = {"benchmark": "runtime_map_gpu", "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "batch": args.batch, "size": args.size, "steps": args.steps, "depth": args.depth,
              "post_fraction": args.post_fraction, "synthetic_sorts": sorts,
              "ms_per_batch": {"copy": copy_s * 1e3, "stage": stage_s * 1e3, "transfers": transfer_s * 1e3,
                               "compute": compute_s * 1e3, "post": post_s * 1e3,
                               "bound": bound_s * 1e3, "sequential": seq_s * 1e3, "map": map_s * 1e3},
              "fraction_of_bound": fraction, "speedup_vs_sequential": seq_s / map_s, "target": args.target,
              "identical_results": same, "passed": passed, "seconds": time.perf_counter() - started}
    print(json.dumps(report, indent=1))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "runtime_map_gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
