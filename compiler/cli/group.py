"""The ``trtc`` command group: one-line errors with their exit codes, logging set up per command, ``--debug``.

Errors the user can fix (``TrtcError``) become one line on stderr and the documented exit
code; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
from collections.abc import Callable
from typing import Any

import click

from compiler.core.errors import EXIT_CODES, TrtcError

__all__ = ["cli", "common_options", "UserError", "TrtcGroup"]

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


@click.group(cls=TrtcGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(package_name="trtc")
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    ctx.meta["trtc.debug"] = debug


cli.help = ("trtc: PyTorch model to verified ONNX, INT8/FP16 graphs and TensorRT engines.\n\n\b\nExit codes:\n"
            + "\n".join(f"  {code}  {meaning}" for code, meaning in EXIT_CODES.items()))
