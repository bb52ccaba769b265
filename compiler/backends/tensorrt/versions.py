"""Which TensorRT trtc builds with: the supported versions, the check before a build, the network flag.

trtc needs TensorRT 10.12 or later (strongly typed networks are complete from there) and knows 10.x and 11.x.
Asking which TensorRT is installed imports it, so nothing asks while a loader chain is constructed (``loaders``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from compiler.core.capabilities import tensorrt_version, version_tuple
from compiler.core.errors import BuildError, TensorRTNotInstalled

__all__ = ["SUPPORTED_MAJORS", "MIN_TENSORRT", "NOT_INSTALLED", "tensorrt_version_problem", "require_tensorrt",
           "strongly_typed_flag"]

log = logging.getLogger(__name__)

SUPPORTED_MAJORS = (10, 11)
# Strongly typed networks are complete from TensorRT 10.12 (NVIDIA's TensorRT 11 migration notes): every graph trtc
# writes (Q/DQ, casts) builds as written from there on.
MIN_TENSORRT = (10, 12)
NOT_INSTALLED = ("TensorRT is not installed: engines not built; install trtc[tensorrt] on a machine with an NVIDIA "
                 "GPU and run `trtc rebuild {directory}`")


def tensorrt_version_problem(version: str) -> str | None:
    """Why trtc cannot use TensorRT ``version`` (one line naming the fix), or None: it needs 10.12 or later."""
    numbers = version_tuple(version)[:2]
    if len(numbers) < 2 or numbers < MIN_TENSORRT:
        floor = ".".join(map(str, MIN_TENSORRT))
        return (f"TensorRT {version} is too old: trtc needs {floor} or later (strongly typed networks are complete "
                f"from {floor}); install trtc[tensorrt] to get a supported version")
    return None


def require_tensorrt(directory: Path | str | None = None) -> str:
    """The TensorRT version, after checking that it is installed and one that trtc supports (10.12 to 11.x).

    Raises ``TensorRTNotInstalled`` (exit code 4) naming ``trtc rebuild DIR`` as the way to finish the
    directory later, or ``BuildError`` for a TensorRT older than ``MIN_TENSORRT``.
    """
    version = tensorrt_version()
    if version is None:
        raise TensorRTNotInstalled(NOT_INSTALLED.format(directory=directory if directory is not None else "DIR"))
    problem = tensorrt_version_problem(version)
    if problem:
        raise BuildError(problem)
    if version_tuple(version)[0] > SUPPORTED_MAJORS[-1]:
        log.warning("TensorRT %s is newer than trtc knows (10.x, 11.x); building anyway", version)
    return version


def strongly_typed_flag() -> bool:
    """Whether to ask Polygraphy for a STRONGLY_TYPED network (``strongly_typed=True``).

    TensorRT 10 builds a weakly typed network unless the flag is set, and then the builder's precision
    flags (which trtc never sets) would decide layer precision instead of the graph's Q/DQ and casts:
    the flag is required. TensorRT 11 networks are always strongly typed; the flag is deprecated and
    ignored there. Polygraphy 0.53 sets it with ``getattr(NetworkDefinitionCreationFlag, "STRONGLY_TYPED")``
    and fails ("not available") if a release drops the enum member, so on 11.x the flag is asked for only
    while the enum still has it. Asking imports TensorRT: only a build step asks
    (``loaders.StronglyTypedNetworkFromOnnxPath`` when called, and the parser's second look at a failed parse);
    without TensorRT the answer is 10.x's.
    """
    version = tensorrt_version()
    if version is None or version_tuple(version) < (11,):
        return True
    import tensorrt as trt

    return hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED")
