"""``trtc export``, ``trtc calibrate`` and ``trtc build``: the commands that make a build directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from compiler.cli.group import cli, common_options
from compiler.cli.options import (
    BucketsType,
    buckets_text,
    build_options,
    calibration_options,
    export_options,
    model_options,
    precision_options,
    profile_of,
)
from compiler.core import defaults
from compiler.core.errors import InputError, TrtcError

BEFORE = "interpreter start, torch import, options"  # what a command's time record holds before its own stages


@cli.command("export")
@model_options
@click.option("--out", type=click.Path(path_type=Path), help="Output directory (model.onnx, manifest.json).")
@click.option("--buckets", type=BucketsType(), help="Batch buckets; the largest bounds the dynamic batch and is "
              f"verified (default {buckets_text(defaults.BUCKETS)}).")
@export_options
@common_options
def export_cmd(**kw: Any) -> None:
    """Export a PyTorch model to folded, verified ONNX.

    \b
    Examples:
      trtc export model.pt2 --out build/m
      trtc export model.ts --input images:Bx3x224x224 --out build/m
      trtc export model.onnx --example-data inputs.npz --out build/m
      trtc export --model-factory examples.models:transformer_encoder \\
          --input input_ids:BxS:int64 --input attention_mask:BxS:int64 --dim S=1:128:512 --out build/tr
      trtc export --profile profiles/resnet_digits.toml
    """
    from compiler.core.progress import recording_stages, stage_timer

    with recording_stages(before=BEFORE) as times:
        with stage_timer("imports"):
            from compiler.core.profile import export_settings
            from compiler.core.report import print_export_summary, print_stage_times
            from compiler.pipeline.export import export_directory

        settings = export_settings(kw, profile_of(kw))
        manifest = export_directory(settings)
        print_export_summary(manifest, settings.out)
        print_stage_times(times)


@cli.command("calibrate")
@click.argument("directory", type=click.Path(path_type=Path))
@precision_options("int8", "fp16", "fp8", "int4")
@calibration_options
@common_options
def calibrate_cmd(directory: Path, precision: str | None, **kw: Any) -> None:
    """Add an INT8, FP8, INT4 weight-only or FP16 ONNX model to an export directory, checked by the accuracy gate.

    \b
    Examples:
      trtc calibrate build/m --int8 --calib-data calib.npz --eval-data eval.npz
      trtc calibrate build/m --fp8 --calib-data calib.npz
      trtc calibrate build/m --int4-weights --calib-data calib/ --int4-block 32 --int4-method awq
      trtc calibrate build/m --fp16 --calib-data calib/ --keep-fp32 Softmax
    """
    from calibration.calibrate import CALIBRATION_FILES, calibrate_directory
    from calibration.data import checked_up_front
    from compiler.core.profile import calibration_settings
    from compiler.core.report import print_accuracy

    if precision is None:
        raise InputError("choose --int8, --fp8, --int4-weights or --fp16")
    settings = calibration_settings(kw, precision)
    cache = settings.calib_cache or (directory / CALIBRATION_FILES[precision] if precision in CALIBRATION_FILES
                                     else None)
    checked_up_front(settings, None, Path(cache) if cache else None)  # data where needed, before any model loads
    calibrate_directory(directory, settings)
    print_accuracy(directory)


@cli.command("build")
@model_options
@click.option("--out", type=click.Path(path_type=Path), help="Output directory (default build/<model name>).")
@click.option("--buckets", type=BucketsType(), help="Batch buckets, one engine each (default "
              f"{buckets_text(defaults.BUCKETS)}).")
@precision_options("int8", "fp16", "fp8", "int4", "fp32")
@click.option("--engine", type=click.Choice(["tensorrt", "none"]),
              help="'none' stops after the ONNX and calibration artifacts, on purpose (exit 0).")
@export_options
@calibration_options
@build_options
@common_options
def build_cmd(precision: str | None, **kw: Any) -> None:
    """Build TensorRT engines per batch bucket: export, calibrate, build, in one directory.

    \b
    Examples:
      trtc build model.pt --int8 --buckets 1,4,8,16 --calib-data calib.npz --out build/m
      trtc build model.pt --fp16 --calib-data calib/ --out build/m
      trtc build model.pt --fp8 --calib-data calib.npz --out build/m
      trtc build model.pt --int4-weights --calib-data calib/ --engine none --out build/m
      trtc build --profile profiles/resnet_digits.toml
    Without TensorRT, everything but the engines is written and trtc exits with 4 (see trtc --help).
    """
    from compiler.core.progress import recording_stages, stage_timer

    with recording_stages(before=BEFORE) as times:
        with stage_timer("imports"):  # the pipeline's modules: onnx, onnxruntime, calibration
            import compiler.pipeline.build  # noqa: F401
            from compiler.core.report import print_stage_times
        _build(precision, kw)
        print_stage_times(times)


def _build(precision: str | None, kw: dict[str, Any]) -> None:
    """``trtc build``'s body: settings from the options and the profile, the build, its summary."""
    from compiler.core.profile import build_settings, calibration_settings, export_settings
    from compiler.core.report import print_build_summary
    from compiler.core.settings import REDUCED_PRECISIONS
    from compiler.pipeline.build import build_directory

    if kw.get("out") is None and kw.get("model") and not kw.get("profile"):
        kw["out"] = Path("build") / Path(kw["model"]).stem
    profile = profile_of(kw)
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
