"""The ``trtc`` command line: parse, call one library function, print. One module per group of commands."""

from __future__ import annotations

from compiler.cli import bench, build, diagnose, engines, triton
from compiler.cli.group import cli

__all__ = ["cli", "main"]

_COMMANDS = (build, engines, bench, triton, diagnose)  # imported for their commands, which register on ``cli``


def main() -> None:
    cli.main(prog_name="trtc")
