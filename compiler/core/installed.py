"""Which optional libraries are installed here: asked by every layer, so it sits at the bottom."""

from __future__ import annotations

import logging

__all__ = ["tensorrt_version", "version_tuple"]

log = logging.getLogger(__name__)


def version_tuple(version: str) -> tuple[int, ...]:
    """The numeric dot-separated parts of a version: "10.12.0.36" -> (10, 12, 0, 36); compare tuples, not strings."""
    return tuple(int(p) for p in version.split(".") if p.isdigit())


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
