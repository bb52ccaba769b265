"""The ``trtc`` command line: parse, call one library function, print.

Errors the user can fix (``TrtcError``) become one line on stderr and the documented exit
code; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from compiler.core import defaults
from compiler.core.errors import EXIT_CODES, InputError, TrtcError
from compiler.core.settings import HARDWARE_COMPAT_LEVELS
from compiler.core.specs import DimRange, InputSpec, parse_buckets, parse_dim_range, parse_input_spec

__all__ = ["cli", "main"]

log = logging.getLogger("trtc")


class UserError(click.ClickException):
    """A TrtcError shown the CLI's way: ``error: <message>`` and its exit code."""

    def __init__(self, err: TrtcError) -> None:
        super().__init__(str(err))
        self.exit_code = err.exit_code  # type: ignore[misc]

    def show(self, file: Any = None) -> None:
        click.echo(f"error: {self.message}", err=True)


class TrtcGroup(click.Group):
    def main(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        """Run without click's standalone handling so that usage errors are one line too."""
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
        except click.UsageError as err:
            click.echo(f"error: {err.format_message()} (see --help)", err=True)
            sys.exit(err.exit_code)
        except click.ClickException as err:
            err.show()
            sys.exit(err.exit_code)
        except click.exceptions.Abort:
            click.echo("aborted", err=True)
            sys.exit(130)
        sys.exit(rv if isinstance(rv, int) else 0)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except TrtcError as err:
            if ctx.meta.get("trtc.debug"):
                raise
            raise UserError(err) from err


class InputSpecType(click.ParamType):
    name = "NAME:SHAPE[:DTYPE]"

    def convert(self, value: Any, param: Any, ctx: Any) -> InputSpec:
        if isinstance(value, InputSpec):
            return value
        try:
            return parse_input_spec(value)
        except InputError as err:
            self.fail(str(err), param, ctx)


class DimType(click.ParamType):
    name = "NAME=MIN:OPT:MAX"

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[str, DimRange]:
        if isinstance(value, tuple):
            return value
        try:
            return parse_dim_range(value)
        except InputError as err:
            self.fail(str(err), param, ctx)


class BucketsType(click.ParamType):
    name = "N,N,..."

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            buckets = parse_buckets(value)
        except InputError as err:
            self.fail(str(err), param, ctx)
        given = [p.strip() for p in str(value).split(",")]
        if [str(b) for b in buckets] != given:
            click.echo(f"note: buckets {value} normalized to {','.join(map(str, buckets))} (sorted, repeats removed)",
                       err=True)
        return buckets


def _setup(ctx: click.Context, debug: bool, quiet: bool) -> None:
    ctx.meta["trtc.debug"] = ctx.meta.get("trtc.debug") or debug
    if not debug:  # the exporters warn about things the user cannot act on (torchvision ops, pytree)
        warnings.filterwarnings("ignore")
        import torch  # noqa: F401  (torch configures its loggers on import; quiet them after)

        logging.getLogger("torch").setLevel(logging.ERROR)
    level = logging.WARNING if quiet else logging.INFO
    from rich.logging import RichHandler

    handler = RichHandler(show_time=False, show_path=False, markup=False, rich_tracebacks=False)
    for name in ("compiler", "calibration", "trtc"):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level)
        logger.propagate = False


def common_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--debug and --quiet on every command."""

    @click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
    @click.option("--quiet", "-q", is_flag=True, help="Only warnings and errors.")
    @functools.wraps(fn)
    def wrapper(*args: Any, debug: bool, quiet: bool, **kwargs: Any) -> Any:
        _setup(click.get_current_context(), debug, quiet)
        return fn(*args, **kwargs)

    return wrapper


def model_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Where the model comes from and what its inputs look like (shared by export, build, bench)."""
    options = [
        click.argument("model", required=False, type=click.Path(path_type=Path)),
        click.option("--model-factory", metavar="PKG.MODULE:FN", help="Build the model by calling this function."),
        click.option("--weights", type=click.Path(path_type=Path), help="State dict for --model-factory "
                     "(loaded with weights_only=True)."),
        click.option("--trust-pickle", is_flag=True, default=None,
                     help="Allow loading a pickled nn.Module (torch.save(model)): this runs code from the file."),
        click.option("--input", "inputs", multiple=True, type=InputSpecType(),
                     help="An input as NAME:SHAPE[:DTYPE]; a letter marks a dynamic dim (B = batch). An integer "
                     "DTYPE may end in [LOW,HIGH), the values example inputs take (default zeros), e.g. "
                     "'token_type_ids:BxS:int64[0,2)'. Repeat it."),
        click.option("--dim", "dims", multiple=True, type=DimType(),
                     help="Range of a non-batch dynamic dim, NAME=MIN:OPT:MAX (e.g. S=1:128:512)."),
        click.option("--profile", type=click.Path(path_type=Path),
                     help="A profiles/*.toml file; command-line options override its values."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def tolerance_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--atol and --rtol of the export check (shared by export and build)."""
    fn = click.option("--rtol", type=float, help="Export check, relative part: an element may differ by atol x "
                      f"max(1, output scale) + rtol x |reference| (default {defaults.RTOL:g}).")(fn)
    return click.option("--atol", type=float, help="Export check, absolute part (default "
                        f"{defaults.ATOL:g}; see --rtol).")(fn)


def _buckets(buckets: tuple[int, ...]) -> str:
    return ",".join(str(b) for b in buckets)


def _profile(kw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    from compiler.core.profile import load_profile

    return load_profile(kw["profile"]) if kw.get("profile") else {}


@click.group(cls=TrtcGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="trtc")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    ctx.meta["trtc.debug"] = debug


cli.help = ("trtc: PyTorch model to verified ONNX, INT8/FP16 graphs and TensorRT engines.\n\n\b\nExit codes:\n"
            + "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items()))


@cli.command("export")
@model_options
@click.option("--out", type=click.Path(path_type=Path), help="Output directory (model.onnx, manifest.json).")
@click.option("--buckets", type=BucketsType(), help="Batch buckets; the largest bounds the dynamic batch and is "
              f"verified (default {_buckets(defaults.BUCKETS)}).")
@click.option("--opset", type=int, help="ONNX opset (default: the exporter's choice).")
@tolerance_options
@click.option("--force", is_flag=True, help="Replace a directory that holds another model's build.")
@common_options
def export_cmd(**kw: Any) -> None:
    """Export a PyTorch model to folded, verified ONNX.

    \b
    Examples:
      trtc export model.pt2 --out build/m
      trtc export model.ts --input images:Bx3x224x224 --out build/m
      trtc export --model-factory examples.models:transformer_encoder \\
          --input input_ids:BxS:int64 --input attention_mask:BxS:int64 --dim S=1:128:512 --out build/tr
      trtc export --profile profiles/resnet_digits.toml
    """
    from compiler.core.profile import export_settings
    from compiler.core.report import print_export_summary
    from compiler.pipeline.export import export_directory

    settings = export_settings(kw, _profile(kw))
    manifest = export_directory(settings)
    print_export_summary(manifest, settings.out)


def calibration_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Calibration data, method and accuracy gate (shared by calibrate and build)."""
    options = [
        click.option("--calib-data", help="Calibration data: .npz/.npy file or folder, image folder, or 'random' "
                     "(smoke tests only)."),
        click.option("--calib-loader", metavar="PKG.MODULE:FN", help="A function yielding {input_name: array}."),
        click.option("--calib-samples", type=int, help=f"Use at most N samples (default {defaults.CALIB_SAMPLES})."),
        click.option("--calib-batch", type=int, help="Samples per calibration batch (default "
                     f"{defaults.CALIB_BATCH})."),
        click.option("--calib-method", type=click.Choice(defaults.CALIB_METHODS),
                     help=f"How the INT8 range is chosen (default {defaults.CALIB_METHOD}: the --percentile quantile "
                     "of |x|, "
                     "raised where clipping would cost more than INT8 rounding saves)."),
        click.option("--percentile", type=float, help="Percentile of |x| for --calib-method percentile "
                     f"(default {defaults.PERCENTILE:g})."),
        click.option("--calib-cache", type=click.Path(path_type=Path), help="Reuse this calibration.json when model, "
                     "data and method match (no recalibration)."),
        click.option("--eval-data", help="Held-out data for the accuracy gate (default: the calibration data)."),
        click.option("--labels", help="Labels for top-1: a .npy file or the key in the .npz data (default "
                     "'labels' when present)."),
        click.option("--max-accuracy-drop", type=float, help="Top-1 points the gate allows (default "
                     f"{defaults.MAX_ACCURACY_DROP:g})."),
        click.option("--min-cosine", type=float, help="Cosine floor vs FP32 without labels (default "
                     f"{defaults.GATE_MIN_COSINE:g})."),
        click.option("--max-fallback", type=int, help="Layers the gate may keep in FP32 (default "
                     f"{defaults.MAX_FALLBACK})."),
        click.option("--keep-fp32", multiple=True, help="Node name or op type to keep in FP32 (repeat)."),
        click.option("--quantize-attention", is_flag=True, default=None,
                     help="Also quantize attention score products (kept in higher precision by default)."),
        click.option("--fp32-rest", is_flag=True, default=None,
                     help="With --int8: run what is not INT8 in FP32 instead of FP16 (the default, as ModelOpt)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@cli.command("calibrate")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--int8", "precision", flag_value="int8", help="INT8 with explicit Q/DQ, FP16 for the rest (needs "
              "calibration data; --fp32-rest for an FP32 rest).")
@click.option("--fp16", "precision", flag_value="fp16", help="FP16 with sensitive parts kept in FP32.")
@calibration_options
@common_options
def calibrate_cmd(directory: Path, precision: str | None, **kw: Any) -> None:
    """Add an INT8 or FP16 ONNX model to an export directory, checked by the accuracy gate.

    \b
    Examples:
      trtc calibrate build/m --int8 --calib-data calib.npz --eval-data eval.npz
      trtc calibrate build/m --fp16 --calib-data calib/ --keep-fp32 Softmax
    """
    from calibration.calibrate import calibrate_directory
    from compiler.core.profile import calibration_settings
    from compiler.core.report import print_accuracy

    if precision is None:
        raise InputError("choose --int8 or --fp16")
    settings = calibration_settings(kw, precision)
    calibrate_directory(directory, settings)
    print_accuracy(directory)


def build_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """How engines are built (shared by build and rebuild)."""
    options = [
        click.option("--multi-profile", is_flag=True, default=None,
                     help="One engine with one optimization profile per bucket (weights stored once)."),
        click.option("--workspace", type=int, metavar="MIB", help="Builder workspace limit in MiB."),
        click.option("--opt-level", type=click.IntRange(0, 5), help="Builder optimization level (default "
                     f"{defaults.OPT_LEVEL})."),
        click.option("--hardware-compat", type=click.Choice(HARDWARE_COMPAT_LEVELS), is_flag=False,
                     flag_value="ampere-plus", default=None, metavar="[LEVEL]",
                     help="Engines for other GPUs than the one building them: ampere-plus (the level when given "
                          "alone: any GPU of compute capability 8.0+) or same-compute-capability. Default none: "
                          "the engines run on the GPU model that built them, and `trtc check` calls them stale on "
                          "any other (an H100's engines on an H200 too)."),
        click.option("--version-compatible", is_flag=True, default=None,
                     help="Engines that later TensorRT versions of the same major can run (recorded)."),
        click.option("--timing-cache", type=click.Path(path_type=Path),
                     help="A timing cache shared across models (DIR/timing.cache is always used too)."),
        click.option("--jobs", type=int, help="Build buckets in parallel, one process per GPU (one process when no "
                     "GPU list is known: builds sharing a GPU time their tactics under load)."),
        click.option("--tf32/--no-tf32", default=None,
                     help=f"Let FP32 layers use TF32 tensor cores (default {'on' if defaults.TF32 else 'off'}, as "
                     "TensorRT and trtexec do; recorded "
                          "as build.tf32). --no-tf32 keeps FP32 layers strict FP32."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


@cli.command("build")
@model_options
@click.option("--out", type=click.Path(path_type=Path), help="Output directory (default build/<model name>).")
@click.option("--buckets", type=BucketsType(), help="Batch buckets, one engine each (default "
              f"{_buckets(defaults.BUCKETS)}).")
@click.option("--int8", "precision", flag_value="int8", help="INT8 with explicit Q/DQ, FP16 for the rest (needs "
              "--calib-data; --fp32-rest for an FP32 rest).")
@click.option("--fp16", "precision", flag_value="fp16", help="FP16 with sensitive parts kept in FP32.")
@click.option("--fp32", "precision", flag_value="fp32", help="FP32 (the default).")
@click.option("--engine", type=click.Choice(["tensorrt", "none"]),
              help="'none' stops after the ONNX and calibration artifacts, on purpose (exit 0).")
@click.option("--opset", type=int, help="ONNX opset (default: the exporter's choice).")
@tolerance_options
@click.option("--force", is_flag=True, help="Replace a directory that holds another model's build.")
@calibration_options
@build_options
@common_options
def build_cmd(precision: str | None, **kw: Any) -> None:
    """Build TensorRT engines per batch bucket: export, calibrate, build, in one directory.

    \b
    Examples:
      trtc build model.pt --int8 --buckets 1,4,8,16 --calib-data calib.npz --out build/m
      trtc build model.pt --fp16 --calib-data calib/ --out build/m
      trtc build --profile profiles/resnet_digits.toml
    Without TensorRT, everything but the engines is written and trtc exits with 4 (see trtc --help).
    """
    from compiler.core.profile import build_settings, calibration_settings, export_settings
    from compiler.core.report import print_build_summary
    from compiler.core.settings import REDUCED_PRECISIONS
    from compiler.pipeline.build import build_directory

    if kw.get("out") is None and kw.get("model") and not kw.get("profile"):
        kw["out"] = Path("build") / Path(kw["model"]).stem
    profile = _profile(kw)
    export = export_settings(kw, profile)
    precision = precision or profile.get("build", {}).get("precision", defaults.PRECISION)
    calibration = calibration_settings(kw, precision, profile) if precision in REDUCED_PRECISIONS else None
    build = build_settings(kw, export.buckets, precision, profile)
    try:
        manifest = build_directory(export, calibration, build)
    except TrtcError as err:
        if err.exit_code == 4:  # TensorRT missing: the rest was written; show it before the one-line error
            print_build_summary(export.out)
        raise
    print_build_summary(export.out, manifest)



@cli.command("check")
@click.argument("directory", type=click.Path(path_type=Path))
@common_options
def check_cmd(directory: Path) -> None:
    """Exit 0 when every engine of DIR can run here, 1 when some are stale (printed, with why), 2 on error.

    \b
    An engine is stale when
      - its file is missing, changed, or built from another version of the ONNX;
      - another TensorRT runs here (for a --version-compatible engine: an older one or another major);
      - another GPU model is here, even of the same compute capability (H100 vs H200), unless built
        with --hardware-compat same-compute-capability (same capability) or --hardware-compat
        (ampere-plus: capability 8.0+);
      - another platform (OS, CPU architecture) is here.
    \b
    Example:
      trtc check build/m || trtc rebuild build/m --if-stale
    """
    from compiler.pipeline.check import check_directory

    result = check_directory(directory)
    for line in result.lines():
        click.echo(line)
    click.get_current_context().exit(result.exit_code)


@cli.command("rebuild")
@click.argument("directory", type=click.Path(path_type=Path), required=False)
@click.option("--profile", type=click.Path(path_type=Path),
              help="Rebuild the profile's build.out; with no build there yet, run the whole build.")
@click.option("--if-stale", is_flag=True, help="Do nothing when every engine can run here.")
@common_options
def rebuild_cmd(directory: Path | None, profile: Path | None, if_stale: bool) -> None:
    """Rebuild the engines of DIR from its stored ONNX: no re-export, no recalibration.

    The quantization scales stay exactly as calibrated, whatever the TensorRT version.

    \b
    Examples:
      trtc rebuild build/m --if-stale          # the CI job on a TensorRT upgrade
      trtc rebuild --profile profiles/resnet_digits.toml --if-stale
    """
    from compiler.core.profile import load_profile
    from compiler.pipeline.check import rebuild_directory

    if profile is not None:
        if directory is not None:
            raise InputError("give DIR or --profile, not both")
        settings = load_profile(profile)
        if "out" not in settings.get("build", {}):
            raise InputError(f"{profile}: build.out is not set, so there is no directory to rebuild")
        directory = Path(settings["build"]["out"])
        if not (directory / "manifest.json").is_file():
            click.echo(f"{directory} has no build yet: running trtc build --profile {profile}", err=True)
            click.get_current_context().invoke(build_cmd, profile=profile)
            return
    if directory is None:
        raise InputError("give the build directory to rebuild, or --profile")
    result = rebuild_directory(directory, if_stale)
    if not result.rebuilt:
        click.echo(f"{directory}: every engine can run here; nothing rebuilt")
        return
    for stale in result.stale_before:
        click.echo(f"was stale: {stale}")
    click.echo(f"rebuilt {len(result.engines)} engine(s) in {directory}")


@cli.command("merge")
@click.argument("directory", type=click.Path(path_type=Path))
@click.argument("others", nargs=-1, required=True, type=click.Path(path_type=Path))
@common_options
def merge_cmd(directory: Path, others: tuple[Path, ...]) -> None:
    """Add the engines built in OTHERS (e.g. one bucket per CI job) to DIR.

    Every directory must hold the same ONNX and build settings and come from the same TensorRT and GPU.

    \b
      trtc merge build/m build-b1/m build-b4/m
    """
    from compiler.pipeline.check import merge_manifests

    manifest = merge_manifests(directory, list(others))
    click.echo(f"{directory}: engines for buckets {', '.join(str(e['bucket']) for e in manifest['engines'])}")


class PercentType(click.ParamType):
    name = "PERCENT"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        from compiler.bench.baseline import parse_percent

        if isinstance(value, float):
            return value
        try:
            return parse_percent(value)
        except InputError as err:
            self.fail(str(err), param, ctx)


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
        export = export_settings({**kw, "out": Path("bench-export")}, _profile(kw))
        report = bench_model(export, settings)
    out = console if console.is_terminal else Console(width=200 if settings.wide else 120)  # pipes: a fixed width
    for index, item in enumerate(bench_renderables(report)):
        out.print(item, soft_wrap=index > 0)  # the table fits the width; notes stay one line each, for grep
    report.raise_for_regressions()



@cli.command("export-triton")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--repo", required=True, type=click.Path(path_type=Path), help="Triton model repository to write into.")
@click.option("--name", help="Model name in the repository (default: the directory's name).")
@click.option("--backend", type=click.Choice(["auto", "tensorrt", "onnxruntime"]), default="auto", show_default=True,
              help="tensorrt: the engine as model.plan; onnxruntime: the ONNX; auto: the plan when Triton can use it.")
@click.option("--instances", type=int, default=1, show_default=True, help="Model instances (per GPU).")
@click.option("--max-wait-ms", type=float, default=10.0, show_default=True,
              help="How long Triton's dynamic batcher holds a request for company.")
@click.option("--force", is_flag=True, help="Replace the model's folder when it exists.")
@common_options
def export_triton_cmd(directory: Path, repo: Path, name: str | None, backend: str, instances: int,
                      max_wait_ms: float, force: bool) -> None:
    """Write a Triton Inference Server model repository entry for a build directory.

    \b
    Examples:
      trtc export-triton build/m --repo models/
      trtc export-triton build/m --repo models/ --name resnet --backend onnxruntime --instances 2
    """
    from compiler.pipeline.triton import PLAN_VERSION_FILE, triton_repository

    target = triton_repository(directory, repo, name=name, backend=backend, instances=instances,
                               max_wait_ms=max_wait_ms, force=force)
    click.echo(f"wrote {target}/config.pbtxt and {', '.join(sorted(p.name for p in (target / '1').iterdir()))}")
    version_file = target / "1" / PLAN_VERSION_FILE
    if version_file.is_file():
        click.echo(version_file.read_text().splitlines()[1])


def main() -> None:
    cli.main(prog_name="trtc")


if __name__ == "__main__":
    main()
