"""What can run here: a real TensorRT, a CUDA device, ONNX Runtime's execution providers.

Every layer asks (the runtime picking ``backend="auto"``, bench skipping rows, the checks choosing their
device, the build deciding whether engines can be built), so the answers live here, at the bottom, once.
``capabilities()`` answers all of them together; the functions answer one each.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

__all__ = ["Capabilities", "capabilities", "tensorrt_version", "version_tuple", "cuda_available", "ort_providers",
           "checking_providers", "TENSORRT_MISSING", "available_memory"]

log = logging.getLogger(__name__)

TENSORRT_MISSING = ("TensorRT is not installed (no real `tensorrt` imports); install trtc[tensorrt] on a machine "
                    "with an NVIDIA GPU")


@dataclass(frozen=True)
class Capabilities:
    """What is usable on this machine (``capabilities()``)."""

    tensorrt: str | None  # the version of the real TensorRT that imports, or None
    cuda: bool  # torch sees a CUDA device
    ort_providers: tuple[str, ...]  # ONNX Runtime providers that can load, best first (CPU last, always)

    def tensorrt_unavailable(self) -> str | None:
        """Why TensorRT engines cannot run here, or None."""
        if self.tensorrt is None:
            return TENSORRT_MISSING
        if not self.cuda:
            return "no CUDA device: torch.cuda.is_available() is False"
        return None


def capabilities() -> Capabilities:
    """TensorRT, CUDA and ONNX Runtime's providers as this machine has them now."""
    return Capabilities(tensorrt_version(), cuda_available(), tuple(ort_providers()))


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


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (the runtime's buffers and streams are torch's)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def ort_providers(prefer: list[str] | None = None) -> list[str]:
    """ONNX Runtime execution providers that can actually load here, best first.

    Default: CUDA, then CPU. ONNX Runtime's TensorRT provider only when ``prefer`` names it: it builds its own
    TensorRT engines inside ONNX Runtime, so rows using it measure TensorRT, not ONNX Runtime; and ONNX
    Runtime before 1.27 cannot drive TensorRT 11 (it is then left out with a warning).
    onnxruntime-gpu lists the CUDA provider even where CUDA is missing and then logs errors
    when asked for it, so CUDA is offered only when a CUDA device is visible.
    """
    import onnxruntime as ort

    available = set(ort.get_available_providers())
    order = prefer or ["CUDAExecutionProvider", "CPUExecutionProvider"]
    usable = []
    for name in order:
        if name not in available:
            continue
        if name in ("CUDAExecutionProvider", "TensorrtExecutionProvider") and not cuda_available():
            continue
        if name == "TensorrtExecutionProvider" and not _tensorrt_ep_works(ort.__version__):
            continue
        usable.append(name)
    if "CPUExecutionProvider" not in usable:
        usable.append("CPUExecutionProvider")
    return usable


def _tensorrt_ep_works(ort_version: str) -> bool:
    """Whether ONNX Runtime ``ort_version``'s TensorRT provider can use the TensorRT installed here."""
    trt = tensorrt_version()
    if trt is None:
        return False
    if version_tuple(trt) >= (11,) and version_tuple(ort_version)[:2] < (1, 27):
        log.warning("ONNX Runtime %s cannot drive TensorRT %s (its TensorRT provider needs ONNX Runtime 1.27+); "
                    "leaving the TensorRT provider out", ort_version, trt)
        return False
    return True


def checking_providers(available: list[str] | None = None, cuda: bool | None = None) -> list[str]:
    """The providers for trtc's own ONNX Runtime runs: calibration, the FP16 range pass and the accuracy gate.

    ONNX Runtime's CUDA provider first where it is installed and a CUDA device is visible, then the CPU;
    never the TensorRT provider, which would build engines and choose precisions of its own. ``available``
    (ONNX Runtime's provider list) and ``cuda`` (a device is visible) default to this machine's. Q/DQ runs
    as written on either provider (``onnx_io.SESSION_POLICY``).
    """
    if available is None:
        import onnxruntime as ort

        available = list(ort.get_available_providers())
    if cuda is None:
        cuda = "CUDAExecutionProvider" in available and cuda_available()
    if cuda and "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]



def available_memory() -> int | None:
    """Bytes of memory this machine can give a process now: Linux's ``MemAvailable`` (page cache it can drop
    included), else free physical pages; None where neither can be read."""
    import os

    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None
