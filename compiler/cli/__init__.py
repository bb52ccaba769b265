"""The ``trtc`` command line: parse, call one library function, print. One module per group of commands."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys

from compiler.cli import bench, build, diagnose, engines, triton
from compiler.cli.group import cli

__all__ = ["cli", "main"]

_COMMANDS = (build, engines, bench, triton, diagnose)  # imported for their commands, which register on ``cli``


def main() -> None:
    """The ``trtc`` entry point: the command, then the process ends without the interpreter tearing down every
    object one by one, which takes seconds after a build has loaded torch, ONNX Runtime and a model (3 s of a 26 s
    build of the example CNN on 2 CPU cores). ``atexit`` handlers (logging's flush among them) still run and the
    streams are flushed; the exit code is the command's. An exception that is not ``SystemExit`` (a bug, or
    ``--debug``) ends the usual way, with its traceback."""
    try:
        cli.main(prog_name="trtc")
        code: object = 0
    except SystemExit as exit_:
        code = exit_.code
    if not isinstance(code, int):
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed pipe: nothing left to flush into
            stream.flush()
    os._exit(code)
