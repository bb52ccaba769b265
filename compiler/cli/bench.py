"""``trtc bench``: every backend that runs here, per bucket, on identical inputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from compiler.cli.group import cli, common_options
from compiler.cli.options import BucketsType, PercentType, model_options, profile_of
from compiler.core import defaults
from compiler.core.errors import InputError


@cli.command("bench")
@model_options
@click.option("--buckets", type=BucketsType(), help="Batch sizes to run (default: the build's buckets).")
@click.option("--backends", metavar="NAME,...", help="Run only these: torch, torch-cudagraph, onnxruntime, tensorrt.")
@click.option("--ort-providers", metavar="EP,...", help="ONNX Runtime providers, best first: "
              "CPUExecutionProvider first keeps the onnxruntime rows on the CPU (default: the serving backend's "
              "CUDA provider where usable, else the CPU).")
@click.option("--device", type=click.Choice(["cuda", "cpu"]), help="Device of the torch backends (default: CUDA "
              "when present).")
@click.option("--iterations", "-n", type=int, default=defaults.BENCH_ITERATIONS, show_default=True,
              help="At least this many timed runs per backend and bucket.")
@click.option("--min-seconds", type=float, default=defaults.BENCH_MIN_SECONDS, show_default=True,
              help="And at least this long.")
@click.option("--max-seconds", type=float, help="Stop a measurement after this long, even short of the minimums.")
@click.option("--warmup", type=int, default=defaults.BENCH_WARMUP, show_default=True,
              help="Untimed runs first, at least this many.")
@click.option("--warmup-seconds", type=float, default=defaults.BENCH_WARMUP_SECONDS, show_default=True,
              help="And for at least this long.")
@click.option("--seed", type=int, default=defaults.BENCH_SEED, show_default=True, help="Seed of the random inputs.")
@click.option("--data", type=click.Path(path_type=Path), help="An .npz with one array per input instead of random "
              "inputs.")
@click.option("--threads", type=int, default=defaults.BENCH_THREADS,
              help="ONNX Runtime intra-op threads (default: its own choice).")
@click.option("--tf32/--no-tf32", default=None, help="TF32 for the FP32 math of every row (PyTorch allow_tf32, ONNX "
              "Runtime use_tf32; default: the manifest's build.tf32, else on).")
@click.option("--wide", is_flag=True, help="Every column in the terminal table (default: those that fit 120 "
              "columns; bench.json and bench.csv always have all).")
@click.option("--baseline", type=click.Path(path_type=Path), help="An earlier bench.json of this build: exit 1 on a "
              "regression.")
@click.option("--max-regression", type=PercentType(), default=f"{defaults.BENCH_MAX_REGRESSION * 100:g}%",
              show_default=True,
              help="Slower P50 or lower throughput than the baseline by more than this is a regression.")
@click.option("--report-dir", type=click.Path(path_type=Path), help="Where bench.json/.csv/.png go (default "
              "DIR/report, or ./bench-report for a model file).")
@click.option("--no-plot", is_flag=True, help="Do not draw bench.png.")
@common_options
def bench_cmd(**kw: Any) -> None:
    """Latency, throughput and accuracy of a build on every backend that runs here, per batch bucket.

    MODEL is a build directory, or a model file (with --input) to export to a temporary directory and
    compare eager PyTorch with ONNX Runtime alone. Every row runs a serving backend of compiler.load.
    Backends that cannot run here are listed with why. Inputs: --data, else the build's evaluation or
    calibration data when it is still there, else seeded random values (the table says which).

    \b
    Examples:
      trtc bench build/m
      trtc bench build/m --backends torch,onnxruntime --buckets 1,8 -n 200 --min-seconds 5
      trtc bench build/m --baseline old/bench.json --max-regression 5%
      trtc bench model.pt2 --input images:Bx3x224x224 --buckets 1,8
    """
    from rich.console import Console

    from compiler.bench.harness import bench_directory, bench_model
    from compiler.bench.table import bench_renderables
    from compiler.core.profile import bench_settings
    from compiler.core.report import console

    settings = bench_settings(kw)
    target = kw["model"]
    if target is not None and target.is_dir():
        if kw["model_factory"] or kw["inputs"] or kw["dims"] or kw["profile"] or kw["weights"]:
            raise InputError(f"{target} is a build directory, which records its model and inputs; drop --input, "
                             "--dim, --model-factory, --weights and --profile")
        report = bench_directory(target, settings)
    else:
        from compiler.core.profile import export_settings

        # bench_model exports to a temporary directory
        export = export_settings({**kw, "out": Path("bench-export")}, profile_of(kw))
        report = bench_model(export, settings)
    out = console if console.is_terminal else Console(width=200 if settings.wide else 120)  # pipes: a fixed width
    for index, item in enumerate(bench_renderables(report)):
        out.print(item, soft_wrap=index > 0)  # the table fits the width; notes stay one line each, for grep
    report.raise_for_regressions()
