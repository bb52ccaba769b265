"""Which optional libraries are installed here: asked by every layer, so it sits at the bottom."""

from __future__ import annotations

import logging

__all__ = ["tensorrt_version"]

log = logging.getLogger(__name__)


def tensorrt_version() -> str | None:
    """The version of the TensorRT that imports here, or None.

    Only a real TensorRT counts: a namespace package (a stray ``tensorrt/`` folder, type stubs on
    the path) imports but has neither ``Builder`` nor ``__version__``.
    """
    try:
        import tensorrt
    except (ImportError, OSError) as err:  # OSError: the wheel is there but libnvinfer does not load
        log.debug("TensorRT does not import: %s", err)
        return None
    version = getattr(tensorrt, "__version__", None)
    if not hasattr(tensorrt, "Builder") or not isinstance(version, str):
        return None
    return version
