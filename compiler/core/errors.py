"""Errors a user can fix. Anything else is a bug and keeps its traceback.

Every ``TrtcError`` message says what is wrong and how to fix it; the CLI prints it on
one line and exits with ``exit_code``.
"""

from __future__ import annotations

__all__ = ["TrtcError", "InputError", "ExportError", "VerificationError", "CalibrationError",
           "AccuracyGateError", "BuildError", "TensorRTNotInstalled", "DirectoryLocked", "WorkerCrashed", "EXIT_CODES",
           "first_line"]


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
