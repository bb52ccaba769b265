"""Options shared by several commands, and the parameter types that read shapes, dims, buckets and percents."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from compiler.core import defaults
from compiler.core.errors import InputError
from compiler.core.settings import HARDWARE_COMPAT_LEVELS
from compiler.core.specs import DimRange, InputSpec, parse_buckets, parse_dim_range, parse_input_spec

__all__ = ["InputSpecType", "DimType", "BucketsType", "PercentType", "model_options", "tolerance_options",
           "calibration_options", "build_options", "export_options", "buckets_text", "profile_of", "precision_options",
           "PRECISION_FLAGS"]


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
                     "'token_type_ids:BxS:int64[0,2)'; an empty SHAPE is rank 0. Repeat it. An ONNX file's "
                     "inputs of fixed declared shapes need none."),
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


def export_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """How the export is made and checked (shared by export and build): opset, example data, tolerance, --force."""
    fn = click.option("--force", is_flag=True, help="Replace a directory that holds another model's build.")(fn)
    fn = tolerance_options(fn)
    fn = click.option("--example-data", type=click.Path(path_type=Path), metavar="FILE.npz",
                      help="Real inputs for the export and pass checks: one array per input name, as --calib-data "
                      "(default: generated values).")(fn)
    return click.option("--opset", type=int, help="ONNX opset (default: the exporter's choice).")(fn)


PRECISION_FLAGS = {  # precision: (flag, help)
    "int8": ("--int8", "INT8 with explicit Q/DQ, FP16 for the rest (needs calibration data; --fp32-rest for an FP32 "
             "rest)."),
    "fp16": ("--fp16", "FP16 with sensitive parts kept in FP32."),
    "fp8": ("--fp8", "FP8 (E4M3) Q/DQ on convolutions and GEMMs, FP16 for the rest (needs calibration data; engines "
            "need a GPU of compute capability 8.9+)."),
    "int4": ("--int4-weights", "INT4 weight-only: block-wise INT4 weights for MatMul/Gemm, FP16 activations (see "
             "--int4-block, --int4-method)."),
    "fp32": ("--fp32", "FP32 (the default)."),
}


def precision_options(*precisions: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """One flag per precision (``PRECISION_FLAGS``), passed to the command as ``precision`` (None when none is
    given). Two flags together are refused in one line: a build makes one precision, and --int8 already runs what
    is not INT8 in FP16, which is what --int8 --fp16 would ask for."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kw: Any) -> Any:
            given = [p for p in precisions if kw.pop(f"precision_{p}", False)]
            if len(given) > 1:
                flags = " and ".join(PRECISION_FLAGS[p][0] for p in given)
                reduced = [p for p in given if p != "fp16"]
                hint = (f"; {PRECISION_FLAGS[reduced[0]][0]} alone already runs what is not "
                        f"{reduced[0].upper()} in FP16 (--fp32-rest: FP32)" if "fp16" in given and len(reduced) == 1
                        and reduced[0] in ("int8", "fp8") else "")
                raise InputError(f"{flags} given together: a build makes one precision, choose one{hint}")
            return fn(*args, precision=given[0] if given else None, **kw)

        for precision in reversed(precisions):
            flag, text = PRECISION_FLAGS[precision]
            wrapper = click.option(flag, f"precision_{precision}", is_flag=True, help=text)(wrapper)
        return wrapper

    return decorate


def buckets_text(buckets: tuple[int, ...]) -> str:
    return ",".join(str(b) for b in buckets)


def profile_of(kw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    from compiler.core.profile import load_profile

    return load_profile(kw["profile"]) if kw.get("profile") else {}


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
                     "raised where clipping would cost more than INT8 rounding saves; "
                     f"{defaults.FP8_CALIB_METHOD} for --fp8)."),
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
                     f"{defaults.MAX_FALLBACK}; {defaults.INT4_MAX_FALLBACK} in FP16 for --int4-weights)."),
        click.option("--keep-fp32", multiple=True, help="Node name or op type to keep in FP32 (repeat)."),
        click.option("--quantize-attention", is_flag=True, default=None,
                     help="Also quantize attention score products (kept in higher precision by default)."),
        click.option("--fp32-rest", is_flag=True, default=None,
                     help="With --int8: run what is not INT8 in FP32 instead of FP16 (the default, as ModelOpt)."),
        click.option("--int4-block", type=int, help="With --int4-weights: weights per INT4 scale along the "
                     f"reduction axis (default {defaults.INT4_BLOCK})."),
        click.option("--int4-method", type=click.Choice(defaults.INT4_METHODS),
                     help="With --int4-weights: awq (activation-aware scales searched per layer on the calibration "
                     f"data) or rtn (round to nearest, no data) (default {defaults.INT4_METHOD})."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


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
