"""``trtc export-triton`` (a Triton Inference Server model repository entry for a build directory) and ``trtc serve``
(a build directory on Triton, in the foreground)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from compiler.cli.group import cli, common_options
from compiler.cli.options import BucketsType
from compiler.core import defaults

PLATFORMS = ["auto", "tensorrt_plan", "onnxruntime_onnx", "trtc"]


def batching_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Triton's instances and dynamic batcher (shared by export-triton and serve)."""
    options = [
        click.option("--instances", type=int, default=1, show_default=True, help="Model instances (per GPU)."),
        click.option("--max-wait-ms", type=float, default=defaults.MAX_WAIT_MS, show_default=True,
                     help="How long Triton's dynamic batcher holds a request for company."),
        click.option("--preferred-batch-sizes", type=BucketsType(), help="Batch sizes Triton's dynamic batcher "
                     "runs at once when it can form them (default: the buckets; without 1, a lone request waits "
                     "--max-wait-ms)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@cli.command("export-triton")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--repo", required=True, type=click.Path(path_type=Path), help="Triton model repository to write into.")
@click.option("--name", help="Model name in the repository (default: the directory's name).")
@click.option("--platform", type=click.Choice(PLATFORMS), default="auto", show_default=True,
              help="tensorrt_plan: the engine as model.plan; onnxruntime_onnx: the ONNX; trtc: Triton's Python backend "
              "running trtc's runtime on the build (pads batches to the buckets); auto: the plan where Triton can use "
              "it, else trtc for engines it cannot, else onnxruntime_onnx.")
@batching_options
@click.option("--force", is_flag=True, help="Replace the model's folder when it exists.")
@common_options
def export_triton_cmd(directory: Path, repo: Path, name: str | None, platform: str, instances: int,
                      max_wait_ms: float, preferred_batch_sizes: tuple[int, ...] | None, force: bool) -> None:
    """Write a Triton Inference Server model repository entry for a build directory.

    \b
    Examples:
      trtc export-triton build/m --repo models/
      trtc export-triton build/m --repo models/ --name resnet --platform onnxruntime_onnx --instances 2
      trtc export-triton build/m --repo models/ --platform trtc
    """
    from compiler.pipeline.triton import PLAN_VERSION_FILE, triton_repository

    target = triton_repository(directory, repo, name=name, platform=platform, instances=instances,
                               max_wait_ms=max_wait_ms, force=force, preferred_batch_sizes=preferred_batch_sizes)
    click.echo(f"wrote {target}/config.pbtxt and {', '.join(sorted(p.name for p in (target / '1').iterdir()))}")
    version_file = target / "1" / PLAN_VERSION_FILE
    if version_file.is_file():
        click.echo(version_file.read_text().splitlines()[1])


@cli.command("serve")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--port", type=int, default=8000, show_default=True, help="HTTP port.")
@click.option("--grpc-port", type=int, default=8001, show_default=True, help="gRPC port.")
@click.option("--metrics-port", type=int, default=8002, show_default=True, help="Prometheus metrics port.")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address every endpoint binds to (0.0.0.0: "
              "all interfaces).")
@batching_options
@click.option("--name", help="Model name (default: the directory's name).")
@common_options
def serve_cmd(directory: Path, port: int, grpc_port: int, metrics_port: int, host: str, instances: int,
              max_wait_ms: float, preferred_batch_sizes: tuple[int, ...] | None, name: str | None) -> None:
    """Serve a build directory on Triton Inference Server (HTTP and gRPC) until Ctrl-C.

    DIR is exported as a trtc entry (Triton's dynamic batcher in front of trtc's runtime) into a
    temporary model repository; tritonserver comes from PATH or the extra trtc[serve].

    \b
    Examples:
      trtc serve build/demo/engines
      trtc serve build/m --port 9000 --grpc-port 9001 --instances 2
    """
    from compiler.pipeline.serve import ServeEndpoints, serve_directory

    def ready(endpoints: ServeEndpoints) -> None:
        click.echo(f"\nserving {endpoints.model} (tritonserver pid {endpoints.pid}): HTTP {endpoints.http}, gRPC "
                   f"{endpoints.grpc}, metrics {endpoints.metrics}\ntry:\n  {endpoints.curl}\nCtrl-C stops it.",
                   err=True)

    serve_directory(directory, on_ready=ready, host=host, http_port=port, grpc_port=grpc_port,
                    metrics_port=metrics_port, instances=instances, max_wait_ms=max_wait_ms, name=name,
                    preferred_batch_sizes=preferred_batch_sizes)
    click.echo("stopped", err=True)
