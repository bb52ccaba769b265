"""``compiler.load(DIR)``: a build directory's engines, ready to serve, on the backend asked for (``auto``:
TensorRT where it is installed, else ONNX Runtime, said once in a log line so that a service still starts on a
node without TensorRT). ``engines_from_module`` serves an in-memory ``torch.nn.Module`` the same way."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from compiler.backends.onnxrt import OrtBackend
from compiler.backends.registry import ServingSource, serving_backend
from compiler.core import defaults
from compiler.core.capabilities import tensorrt_version
from compiler.core.errors import InputError
from compiler.core.settings import ServeSettings
from compiler.core.specs import DimRange, InputSpec, ModelSpec, parse_dim_range, parse_input_spec
from compiler.serve.collector import freeze_alive
from compiler.serve.engines import Engines

__all__ = ["load", "engines_from_module"]

log = logging.getLogger(__name__)

_FALLBACK_LOGGED: set[str] = set()
_FALLBACK_LOCK = threading.Lock()


def _log_fallback_once(directory: Path, backend: OrtBackend) -> None:
    key = str(directory.resolve())
    with _FALLBACK_LOCK:
        if key in _FALLBACK_LOGGED:
            return
        _FALLBACK_LOGGED.add(key)
    log.warning("TensorRT is not installed here: serving %s with ONNX Runtime (%s) on %s", directory,
                backend.provider, backend.path.name)


def load(directory: str | Path, backend: str = defaults.SERVE_BACKEND, *, device: str | None = None,
         contexts: int = defaults.CONTEXTS, cuda_graphs: bool = defaults.CUDA_GRAPHS,
         threads: int = defaults.ORT_THREADS, trust_pickle: bool = False, tf32: bool | None = None,
         ort_cuda_options: Mapping[str, str] | None = None, precision: str | None = None,
         freeze_gc: bool = defaults.FREEZE_GC) -> Engines:
    """The engines of a build directory, ready to serve: ``engines(x)``, ``engines.map(...)``.

    ``backend``: ``auto`` (TensorRT when installed, else ONNX Runtime, logged once), ``tensorrt``,
    ``onnxruntime`` or ``torch`` (the source model, eager). TensorRT engines are checked as
    ``trtc check`` does; a stale or missing engine raises ``EnginesNotRunnable`` naming
    ``trtc rebuild``, a missing TensorRT ``TensorRTNotInstalled``. ``device``: ``cpu``, ``cuda``
    or ``cuda:N``; None picks the GPU when the backend can use one. ``contexts``: how many callers
    run at once (each context holds buffers for every bucket). ``cuda_graphs``: replay CUDA graphs
    on a GPU: one per bucket, captured at load, for a model whose only dynamic dimension is the
    batch (ONNX Runtime: where it allows it, ``compiler.backends.onnxrt``); for other models torch
    captures one per bucket and shape at its first run, and TensorRT and ONNX Runtime run them
    without graphs. ``threads``: ONNX Runtime's intra-op threads
    (0: its default). ``trust_pickle``: let the torch backend load a pickled model file. ``tf32``:
    whether ONNX Runtime's CUDA provider may use TF32 for FP32 math (default: the manifest's
    ``build.tf32``, else True, as the TensorRT engines were built); the torch backend follows
    PyTorch's own ``torch.backends`` flags. ``ort_cuda_options``: CUDA provider options over
    ``compiler.backends.onnxrt.CUDA_OPTIONS``. ``precision``: which of the build's ONNX files
    ONNX Runtime serves (default the manifest's precision). ``freeze_gc``: move the objects alive before
    the load out of the garbage collector's view (``gc.freeze``, after one collection), so that its full
    collections, a quarter of a second with torch imported, do not stall requests (``compiler.serve.collector``).
    """
    from compiler.core.manifest import read_manifest

    settings = ServeSettings(backend=backend, device=device, contexts=contexts, cuda_graphs=cuda_graphs,
                             threads=threads, trust_pickle=trust_pickle, tf32=tf32,
                             ort_cuda_options=dict(ort_cuda_options or {}), precision=precision)
    directory = Path(directory)
    manifest = read_manifest(directory)
    spec = manifest.spec
    buckets = manifest.buckets
    if not buckets:
        raise InputError(f"{directory}: the manifest lists no buckets; run `trtc export` into it again")
    if freeze_gc:
        freeze_alive()
    chosen = backend
    if backend == "auto":
        chosen = "tensorrt" if tensorrt_version() is not None else "onnxruntime"
    module = None
    if chosen == "torch":
        from compiler.frontend.loading import load_snapshot

        if manifest.precision != "fp32":
            log.info("backend torch runs the FP32 source model, not the %s graph", manifest.precision)
        module = load_snapshot(directory, manifest, trust_pickle).module  # the weights that were exported
    impl = serving_backend(chosen, ServingSource(directory, manifest, spec, buckets, module), settings)
    engines = Engines(impl, contexts)
    if backend == "auto" and isinstance(impl, OrtBackend):
        _log_fallback_once(directory, impl)
    log.info("serving %s with %s on %s: buckets %s, up to %d concurrent contexts", directory, engines.backend,
             engines.device, ",".join(map(str, engines.buckets)), contexts)
    return engines


def engines_from_module(module: Any, inputs: Sequence[str | InputSpec] | ModelSpec,
                        buckets: Sequence[int] = defaults.BUCKETS, *, dims: Mapping[str, str | DimRange] | None = None,
                        output_names: Sequence[str] | None = None, device: str | None = None,
                        contexts: int = defaults.CONTEXTS, cuda_graphs: bool = defaults.CUDA_GRAPHS) -> Engines:
    """An in-process ``torch.nn.Module`` served like a build directory (backend ``torch``), without export.

    ``inputs`` as on the command line (``"x:Bx64"``), ``dims`` as ``{"S": "1:128:512"}``. For
    benchmarks of the runtime itself and for serving a model that has no build yet.
    """
    if isinstance(inputs, ModelSpec):
        spec = inputs
    else:
        specs = tuple(parse_input_spec(i) if isinstance(i, str) else i for i in inputs)
        ranges = {name: parse_dim_range(f"{name}={r}")[1] if isinstance(r, str) else r
                  for name, r in (dims or {}).items()}
        spec = ModelSpec(specs, ranges)
    settings = ServeSettings(backend="torch", device=device, contexts=contexts, cuda_graphs=cuda_graphs)
    from compiler.core.manifest import Manifest

    source = ServingSource(None, Manifest(output_names=tuple(output_names or ())), spec, tuple(buckets), module)
    return Engines(serving_backend("torch", source, settings), contexts)
