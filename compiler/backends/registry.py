"""Every backend by name: the factory of its serving backend, its check runner, and why it cannot run here.

``compiler.load`` and ``trtc bench`` make serving backends here (``serving_backend``), the export checks and
the accuracy gate make check runners here (``check_runner``), and every one of them asks ``unavailable``
before it tries. To add a backend: a module in this package with its ``Backend`` (and ``Runner`` if trtc's
checks can use it), and one ``BackendKind`` in ``REGISTRY``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler.backends.base import Backend, Runner
from compiler.core.capabilities import capabilities, cuda_available, ort_providers
from compiler.core.errors import InputError
from compiler.core.settings import ServeSettings
from compiler.core.specs import ModelSpec

if TYPE_CHECKING:
    from compiler.core.manifest import Manifest

__all__ = ["BACKENDS", "REGISTRY", "BackendKind", "ServingSource", "serving_backend", "check_runner", "unavailable"]


@dataclass(frozen=True)
class ServingSource:
    """What a serving backend is made from: a build directory (None for a module served without a build) and its
    manifest (for a module, one that records only its ``output_names``), the input spec, the buckets to serve, the
    eager module for the torch backend (the build's snapshot, loaded by the caller, or a module in memory), and for
    ONNX Runtime the graph when the caller has verified it already (else the manifest's for the settings'
    precision)."""

    directory: Path | None
    manifest: Manifest
    spec: ModelSpec
    buckets: tuple[int, ...]
    module: Any = None
    onnx: Path | None = None


@dataclass(frozen=True)
class BackendKind:
    """One backend: ``serving`` makes its serving backend, ``checks`` its check runner (None: it has none),
    ``unavailable(device)`` says why it cannot run here on ``device`` (None: it can)."""

    name: str
    serving: Callable[[ServingSource, ServeSettings], Backend]
    checks: Callable[..., Runner] | None
    unavailable: Callable[[str | None], str | None]


def _tensorrt_serving(source: ServingSource, settings: ServeSettings) -> Backend:
    from compiler.backends.tensorrt.runtime import tensorrt_backend

    if source.directory is None:
        raise InputError("the tensorrt backend serves a build directory's engines: build one with `trtc build`")
    return tensorrt_backend(source.directory, source.manifest, source.spec, settings.device,
                             settings.cuda_graphs)


def _onnxruntime_serving(source: ServingSource, settings: ServeSettings) -> Backend:
    from compiler.backends.onnxrt import OrtBackend

    if source.directory is None:
        raise InputError("the onnxruntime backend serves a build directory's ONNX: export one with `trtc export`")
    path = source.onnx or source.manifest.onnx_for(source.directory, settings.precision)
    tf32 = source.manifest.tf32 if settings.tf32 is None else settings.tf32
    return OrtBackend(path, source.spec, source.buckets, settings.device, settings.threads, tf32=tf32,
                      cuda_options=dict(settings.ort_cuda_options), cuda_graphs=settings.cuda_graphs)


def _torch_serving(source: ServingSource, settings: ServeSettings) -> Backend:
    from compiler.backends.pytorch import TorchBackend

    if source.module is None:
        raise InputError("the torch backend needs the source model: the build's snapshot, or a module")
    return TorchBackend(source.module, source.spec, source.buckets, list(source.manifest.output_names),
                        settings.device, settings.cuda_graphs, autocast_fp16=settings.autocast_fp16)


def _ort_runner(*args: Any, **kwargs: Any) -> Runner:
    from compiler.backends.onnxrt_runner import OnnxRuntimeRunner

    return OnnxRuntimeRunner(*args, **kwargs)


def _torch_runner(*args: Any, **kwargs: Any) -> Runner:
    from compiler.backends.pytorch import TorchRunner

    return TorchRunner(*args, **kwargs)


def _tensorrt_unavailable(device: str | None) -> str | None:
    if device is not None and not device.startswith("cuda"):
        return f"device={device!r}: TensorRT engines run on a CUDA device"
    return capabilities().tensorrt_unavailable()


def _onnxruntime_unavailable(device: str | None) -> str | None:
    if device is not None and device.startswith("cuda") and "CUDAExecutionProvider" not in ort_providers():
        return (f"device={device!r}: ONNX Runtime has no usable CUDA provider here (install onnxruntime-gpu on a "
                "machine with a GPU), or use device='cpu'")
    return None


def _torch_unavailable(device: str | None) -> str | None:
    if device is not None and device.startswith("cuda") and not cuda_available():
        return f"device={device!r}: no CUDA device: torch.cuda.is_available() is False"
    return None


REGISTRY: dict[str, BackendKind] = {
    "tensorrt": BackendKind("tensorrt", _tensorrt_serving, None, _tensorrt_unavailable),
    "onnxruntime": BackendKind("onnxruntime", _onnxruntime_serving, _ort_runner, _onnxruntime_unavailable),
    "torch": BackendKind("torch", _torch_serving, _torch_runner, _torch_unavailable),
}
BACKENDS = tuple(REGISTRY)


def _kind(name: str) -> BackendKind:
    kind = REGISTRY.get(name)
    if kind is None:
        raise InputError(f"backend {name!r}: use one of {', '.join(BACKENDS)}")
    return kind


def serving_backend(name: str, source: ServingSource, settings: ServeSettings) -> Backend:
    """The serving backend ``name`` made from ``source`` (``Engines`` pools its contexts)."""
    return _kind(name).serving(source, settings)


def check_runner(name: str, *args: Any, **kwargs: Any) -> Runner:
    """The check runner of backend ``name``, not yet active: ``onnxruntime`` takes ``OnnxRuntimeRunner``'s arguments
    (an ONNX path or proto, providers, ...), ``torch`` ``TorchRunner``'s (a module, input and output names, ...)."""
    kind = _kind(name)
    if kind.checks is None:
        raise InputError(f"the {name} backend has no check runner: trtc's checks run on onnxruntime and torch")
    return kind.checks(*args, **kwargs)


def unavailable(name: str, device: str | None = None) -> str | None:
    """Why backend ``name`` cannot run here (on ``device``, when given), or None."""
    return _kind(name).unavailable(device)
