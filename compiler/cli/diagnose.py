"""``trtc inspect`` and ``trtc diff``: what a build directory holds, and where its accuracy goes, layer by layer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from compiler.cli.group import cli, common_options
from compiler.core import defaults
from compiler.core.errors import InputError
from compiler.core.settings import REDUCED_PRECISIONS


def _console() -> Any:
    """The report console on a terminal; elsewhere (CI logs, pipes) a wide one, so that plain rows stay one line."""
    from rich.console import Console

    from compiler.core.report import console

    return console if console.is_terminal else Console(width=240)


@cli.command("inspect")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the facts as one JSON document instead of tables.")
@click.option("--layers", is_flag=True, help="Also list every layer with its precision in each graph, and why "
              "a layer stayed out of the reduced precision.")
@common_options
def inspect_cmd(directory: Path, as_json: bool, layers: bool) -> None:
    """What build directory DIR holds: source and export, inputs and outputs, buckets and profiles, each graph
    with its layers by precision and the layers kept out (and why), the accuracy gate, each engine and whether
    it runs here (as trtc check decides). Nothing runs; the graphs are checked against the manifest.

    \b
    Examples:
      trtc inspect build/m
      trtc inspect build/m --layers
      trtc inspect build/m --json | jq '.gate.int8'
    """
    from compiler.diagnose.inspect import inspect_directory, layer_rows
    from compiler.diagnose.tables import inspect_tables, layer_table, render

    facts = inspect_directory(directory)
    if layers:
        facts["layers"] = layer_rows(directory)
    if as_json:
        click.echo(json.dumps(facts, indent=2))
        return
    items = inspect_tables(facts)
    if layers:
        items.append(layer_table(facts["layers"]))
    render(items, _console())


@cli.command("diff")
@click.argument("directory", type=click.Path(path_type=Path))
@click.argument("other", type=click.Path(path_type=Path), required=False)
@click.option("--precision", type=click.Choice(REDUCED_PRECISIONS), help="The precision graph to compare "
              "(default: the build's last reduced precision; with OTHER, each build's last precision).")
@click.option("--data", type=click.Path(path_type=Path), help="Inputs: an .npz/.npy file or folder with one array "
              "per input (default: the build's evaluation data, else its calibration data).")
@click.option("--samples", type=click.IntRange(min=1), default=defaults.DIFF_SAMPLES, show_default=True,
              help="Compare on at most this many samples.")
@click.option("--top", type=click.IntRange(min=1), default=defaults.DIFF_TOP, show_default=True,
              help="Print the worst N layers (diff.json has all).")
@click.option("--sort", type=click.Choice(["isolated", "accumulated"]), default="isolated", show_default=True,
              help="Rank by the layer's own error, or by the graph's error at the layer.")
@click.option("--engines", is_flag=True, help="Also compare the TensorRT engines' outputs with the FP32 ONNX graph "
              "(needs TensorRT).")
@click.option("--report-dir", type=click.Path(path_type=Path), help="Where diff.json and diff.png go (default "
              "DIR/report).")
@click.option("--no-plot", is_flag=True, help="Do not draw diff.png.")
@common_options
def diff_cmd(directory: Path, other: Path | None, precision: str | None, data: Path | None, samples: int, top: int,
             sort: str, engines: bool, report_dir: Path | None, no_plot: bool) -> None:
    """Where the accuracy of DIR's precision graph goes: every layer against FP32, worst first.

    Runs the FP32 and the precision graph on the same inputs in one ONNX Runtime session (the GPU where
    there is one; memory within the calibration budget) and gives each layer, named by its ONNX node,
    two errors: isolated (the layer alone in its precision, fed FP32's inputs to it: a layer broken on its
    own ranks first) and accumulated (the whole graph up to it), as cosine, relative error and max abs;
    then the first layer where the accumulated error jumps. With OTHER, OTHER's graph is compared with
    DIR's (two builds of one model: two TensorRT versions, percentile vs entropy).

    \b
    Examples:
      trtc diff build/m
      trtc diff build/m --precision fp16 --top 30 --sort accumulated
      trtc diff build/m --data more.npz --samples 64
      trtc diff build/percentile build/entropy
    """
    from compiler.core.manifest import read_manifest
    from compiler.diagnose.diff import diff_batches, diff_directories, diff_directory
    from compiler.diagnose.engines import engine_errors, engines_unavailable
    from compiler.diagnose.plot import write_diff_report
    from compiler.diagnose.tables import diff_tables, render

    if not directory.is_dir():
        raise InputError(f"{directory}: no such directory; give a build directory (`trtc build --out DIR`)")
    if other is not None and not other.is_dir():
        raise InputError(f"{other}: no such directory; give a second build directory of the same model")
    if engines:
        if other is not None:
            raise InputError("--engines compares one build's engines with its FP32 graph: drop OTHER or --engines")
        reason = engines_unavailable(read_manifest(directory))
        if reason is not None:
            raise InputError(reason)
    if other is None:
        report = diff_directory(directory, precision, data, samples)
    else:
        report = diff_directories(directory, other, precision, data, samples)
    if engines:
        manifest = read_manifest(directory)
        report.engines = engine_errors(directory, manifest, diff_batches(directory, manifest, data, samples)[0])
    written = write_diff_report(report, report_dir or directory / "report", sort, plot=not no_plot)
    items = diff_tables(report, top, sort)
    items.append(f"wrote {written['json']}" + (f" and {written['png']}" if written["png"] else "")
                 + (f" ({written['note']})" if written["note"] and written["note"] != "--no-plot" else ""))
    render(items, _console())
