"""``trtc check``, ``trtc rebuild`` and ``trtc merge``: the engines of a directory in CI."""

from __future__ import annotations

from pathlib import Path

import click

from compiler.cli.build import build_cmd
from compiler.cli.group import cli, common_options
from compiler.core.errors import InputError


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
    click.echo(f"{directory}: engines for buckets {', '.join(str(e.bucket) for e in manifest.engines)}")
