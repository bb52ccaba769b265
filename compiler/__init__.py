"""trtc: PyTorch to TensorRT engines, checked."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from compiler.serve.load import load as load

from compiler.core.version import __version__

__all__ = ["__version__", "load"]


def __getattr__(name: str) -> Any:
    """``compiler.load`` imports the runtime on first use, so ``import compiler`` stays cheap."""
    if name == "load":
        from compiler.serve.load import load

        return load
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
