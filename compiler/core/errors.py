"""Errors a user can fix. Anything else is a bug and keeps its traceback.

Every ``TrtcError`` message says what is wrong and how to fix it; the CLI prints it on
one line and exits with ``exit_code``.
"""

from __future__ import annotations

import sys
import sysconfig
import traceback
from pathlib import Path

__all__ = ["TrtcError", "InputError", "ExportError", "VerificationError", "CalibrationError",
           "AccuracyGateError", "BuildError", "TensorRTNotInstalled", "DirectoryLocked", "WorkerCrashed", "EXIT_CODES",
           "first_line", "user_frame", "user_code_failure", "raised_by_user_code"]


class TrtcError(Exception):
    """An error the user can fix; the message names the problem and the fix."""

    exit_code = 2


class InputError(TrtcError):
    """A bad model file, shape spec, profile, bucket list or data file."""


class FeedError(InputError, ValueError):
    """A feed that does not match the model: a missing or unknown input, a wrong dtype, rank or size."""


class ExportError(TrtcError):
    """Neither exporter could turn the model into ONNX."""


class VerificationError(TrtcError):
    """ONNX Runtime and eager PyTorch disagree beyond the tolerance."""

    exit_code = 3


class CalibrationError(TrtcError):
    """Calibration data is missing, malformed or unusable."""


class AccuracyGateError(TrtcError):
    """The reduced-precision model misses the accuracy gate even after keeping layers in higher precision."""

    exit_code = 3


class BuildError(TrtcError):
    """TensorRT rejected the network or failed to build an engine."""


class TensorRTNotInstalled(BuildError):
    """Engines were not built because TensorRT is not importable here; every other artifact was written."""

    exit_code = 4


class DirectoryLocked(TrtcError):
    """Another trtc process is writing the same output directory."""


EXIT_CODES = {
    0: "success",
    1: "`trtc check`: some engines are stale; `trtc bench --baseline`: a performance regression",
    2: "a user error: bad input, bad options, a model that cannot be exported, a locked directory",
    3: "a numerical check failed: export verification or the accuracy gate",
    4: "TensorRT is not installed: every artifact but the engines was written (`--engine none` makes this exit 0)",
}


class WorkerCrashed(TrtcError):
    """A child process running a stage (ONNX Runtime work) died from a native crash or was killed."""


def first_line(err: BaseException) -> str:
    """An exception's first line, for a one-line log message (its type's name when it has no text)."""
    return str(err).splitlines()[0] if str(err) else type(err).__name__


_PROJECT = Path(__file__).resolve().parents[2]  # the folder holding the compiler and calibration packages
_OWN = tuple(str(_PROJECT / name) + "/" for name in ("compiler", "calibration"))


def _library_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return tuple(str(Path(r).resolve()) + "/" for r in roots)


def user_frame(err: BaseException) -> str:
    """Where ``err`` was raised in the user's own code: ``file:line in function`` of the innermost frame of its
    traceback that is neither trtc's nor the standard library's nor an installed package's (torch's); the path
    relative to the working directory where it lies inside it. '' when no frame is the user's."""
    roots = _library_roots()
    found = ""
    for frame in traceback.extract_tb(err.__traceback__):
        path = str(Path(frame.filename).resolve()) if not frame.filename.startswith("<") else frame.filename
        if path.startswith("<") or path.startswith(_OWN) or path.startswith(roots):
            continue
        try:
            shown = str(Path(path).relative_to(Path.cwd()))
        except ValueError:
            shown = path
        found = f"{shown}:{frame.lineno} in {frame.name}"
    return found


def user_code_failure(what: str, err: BaseException) -> str:
    """One line for an exception raised by the user's code: ``{what} raised Type: first line (at file:line in fn)``.

    ``what`` names the code (``--model-factory pkg.mod:fn``, ``the model's forward``); the frame is ``user_frame``'s,
    so the line shows the user's code only, never the library frames above or below it."""
    where = user_frame(err)
    return f"{what} raised {type(err).__name__}: {first_line(err)}" + (f" (at {where})" if where else "")


def raised_by_user_code(err: BaseException) -> bool:
    """Whether the innermost frame of ``err``'s traceback is the user's code (``user_frame``): the user's own
    ``raise``, not a library call that rejected what the user passed it."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return False
    last = frames[-1]
    where = user_frame(err)
    return bool(where) and where.endswith(f":{last.lineno} in {last.name}") and Path(last.filename).name in where
