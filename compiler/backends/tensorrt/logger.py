"""The one TensorRT logger of the process: Polygraphy's.

TensorRT keeps the logger that its first builder or runtime was created with; a second logger passed while one
of those lives is ignored with a warning. Polygraphy's loaders create their builders with
``polygraphy.backend.trt.util.get_trt_logger()``, so every builder, parser and runtime trtc creates takes that
one too: TensorRT's messages then go through Polygraphy's logger (its warnings once each, its INFO messages at
Polygraphy's verbose level), whichever of trtc's modules made the object.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import tensorrt as trt

__all__ = ["tensorrt_logger"]


def tensorrt_logger() -> trt.ILogger:
    """The process's TensorRT logger (Polygraphy's, created on first use). Imports TensorRT."""
    from polygraphy.backend.trt.util import get_trt_logger

    logger: trt.ILogger = get_trt_logger()
    return logger
