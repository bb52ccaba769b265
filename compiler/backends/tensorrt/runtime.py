"""The ``tensorrt`` serving backend: the build directory's engines.

``execute_async_v3`` on the context's CUDA stream, tensor addresses bound once per buffer (torch
tensors are the device buffers), pinned host buffers for the copies, and one CUDA graph per
bucket, captured after warm-up, when no input has a dynamic non-batch dimension (a graph is only
valid for the shapes it was captured with) and TensorRT accepted every enqueue of the warm-up and the
capture. ``tensorrt_backend`` makes the checks ``trtc check`` makes before it loads anything.

Memory: a context of a multi-profile engine created with TensorRT's default (STATIC) strategy holds
activation memory for the engine's largest profile, and the runtime keeps one context per bucket
in every pooled context. So contexts are created USER_MANAGED and the bucket contexts of one pooled
context share one buffer, sized once for the largest profile of any engine: they run one after the
other on that context's stream.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler.backends.base import call_sizes, largest_sizes
from compiler.backends.feeds import CheckedFeed
from compiler.backends.gpu import ComputeOrder, GpuContext, capture_graph
from compiler.backends.tensorrt.compat import stale_in
from compiler.backends.tensorrt.environment import environment
from compiler.backends.tensorrt.logger import tensorrt_logger
from compiler.backends.tensorrt.versions import require_tensorrt
from compiler.core.errors import InputError, TrtcError
from compiler.core.files import inside
from compiler.core.manifest import Manifest
from compiler.core.specs import ModelSpec

if TYPE_CHECKING:
    import tensorrt as trt

__all__ = ["EnginesNotRunnable", "bfloat16_refusal", "tensorrt_backend"]

log = logging.getLogger(__name__)


class EnginesNotRunnable(TrtcError):
    """The directory's TensorRT engines cannot run here (none built, stale, unreadable)."""

    exit_code = 1


def bfloat16_refusal(directory: Path, names: list[str]) -> EnginesNotRunnable:
    """The one-line refusal of engines whose inputs or outputs ``names`` are bfloat16.

    The runtime stages every input and output through numpy views of pinned host buffers, and numpy has no
    bfloat16; bfloat16 inside the model (between its inputs and outputs) is not affected.
    """
    return EnginesNotRunnable(f"{directory}: the engines' inputs or outputs {', '.join(names)} are bfloat16, which "
                              "trtc's TensorRT runtime cannot stage (its host buffers are numpy arrays, and numpy has "
                              "no bfloat16); cast them to float32 or float16 at the model's boundary and rebuild")


def _torch_dtype_of(dtype: trt.DataType) -> Any:
    import tensorrt as trt
    import torch

    table = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16, trt.DataType.BF16: torch.bfloat16,
             trt.DataType.INT8: torch.int8, trt.DataType.INT32: torch.int32, trt.DataType.INT64: torch.int64,
             trt.DataType.BOOL: torch.bool, trt.DataType.UINT8: torch.uint8}
    if dtype not in table:
        raise EnginesNotRunnable(f"the engine has an input or output of type {dtype}, which the runtime cannot "
                                 "hold in a torch tensor")
    return table[dtype]


def _shape_of(dims: trt.Dims) -> tuple[int, ...]:
    return tuple(dims[axis] for axis in range(len(dims)))


class _TensorRTBackend:
    name = "tensorrt"

    def __init__(self, directory: Path, manifest: Manifest, spec: ModelSpec, device: str,
                 cuda_graphs: bool) -> None:
        import tensorrt as trt
        import torch

        self.spec = spec
        self.device = device
        self.cuda_graphs = cuda_graphs
        self.runtime = trt.Runtime(tensorrt_logger())
        self.runtime.engine_host_code_allowed = True  # version-compatible engines carry the lean runtime
        engines: dict[str, trt.ICudaEngine] = {}
        self.profiles: dict[int, tuple[trt.ICudaEngine, int]] = {}
        with torch.cuda.device(torch.device(device)):
            for entry in manifest.engines:
                file = entry.file
                if file not in engines:
                    # confined; its sha256 was checked by ``tensorrt_backend`` (``stale_in``) just before
                    path = inside(directory, file, "engine")
                    engine = self.runtime.deserialize_cuda_engine(path.read_bytes())
                    if engine is None:
                        raise EnginesNotRunnable(f"{directory / file}: TensorRT cannot load this engine (see its log "
                                                 f"above); run `trtc rebuild {directory}`")
                    engines[file] = engine
                self.profiles[entry.bucket] = (engines[file], entry.profile)
        self.buckets = tuple(sorted(self.profiles))
        first = next(iter(engines.values()))
        names = [first.get_tensor_name(i) for i in range(first.num_io_tensors)]
        inputs = [n for n in names if first.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if first.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if sorted(inputs) != sorted(spec.input_names):
            raise EnginesNotRunnable(f"the engines take inputs {inputs}, the manifest declares {spec.input_names}; "
                                     f"run `trtc rebuild {directory}`")
        declared = list(manifest.output_names)
        self.output_names = declared if sorted(declared) == sorted(outputs) else outputs
        self.dtypes = {n: _torch_dtype_of(first.get_tensor_dtype(n)) for n in names}
        bfloat16 = [n for n in names if self.dtypes[n] == torch.bfloat16]
        if bfloat16:  # outputs too: the manifest does not say their types
            raise bfloat16_refusal(directory, bfloat16)
        # activation memory for the largest profile of any engine: what one bucket context at a time needs
        self.scratch_bytes = max(engine.get_device_memory_size_for_profile_v2(profile)
                                 for engine, profile in self.profiles.values())
        self.graph_fallback_said = False
        with torch.cuda.device(torch.device(device)):
            self.order = ComputeOrder()

    def new_context(self) -> _TensorRTContext:
        return _TensorRTContext(self)

    def close(self) -> None:
        self.profiles.clear()


@dataclass
class _TrtBucket:
    context: trt.IExecutionContext
    outputs_flat: dict[str, Any]
    shape_key: tuple[int, ...] | None = None
    outputs: dict[str, Any] = field(default_factory=dict)  # views of outputs_flat at the current shapes
    graph: Any = None


class _CheckedLaunch:
    """``execute_async_v3`` on one stream for warm-up and graph capture, remembering whether TensorRT accepted
    every call: a refused enqueue inside a capture leaves an empty graph that would replay stale outputs."""

    def __init__(self, execute: Callable[[int], bool], stream_handle: int) -> None:
        self._execute = execute
        self._handle = stream_handle
        self.calls = 0
        self.all_accepted = True

    def __call__(self) -> bool:
        accepted = bool(self._execute(self._handle))
        self.calls += 1
        self.all_accepted = self.all_accepted and accepted
        return accepted


class _TensorRTContext(GpuContext):
    """One IExecutionContext per bucket with its optimization profile; addresses bound once, at creation.

    The bucket contexts share one USER_MANAGED activation buffer (``backend.scratch_bytes``). Warm-up and
    graph capture run under the backend's compute order, like every run: a context made while another one
    serves must not run a profile while the other runs it (``NvInferRuntime.h``: concurrent contexts with
    dynamic shapes need separate profiles).
    """

    def __init__(self, backend: _TensorRTBackend) -> None:
        import tensorrt as trt
        import torch

        super().__init__(backend.spec, backend.buckets, backend.device, backend.dtypes, backend.order)
        self._backend = backend
        self._buckets: dict[int, _TrtBucket] = {}
        handle = self.stream.cuda_stream
        with torch.cuda.device(self.device):
            self._scratch: Any = torch.empty(max(backend.scratch_bytes, 1), dtype=torch.uint8, device=self.device)
            for b in backend.buckets:
                engine, profile = backend.profiles[b]
                context = engine.create_execution_context(trt.ExecutionContextAllocationStrategy.USER_MANAGED)
                if context is None:
                    raise EnginesNotRunnable(f"TensorRT could not create an execution context for bucket {b} (out of "
                                             "GPU memory?); use fewer contexts or buckets")
                if engine.num_optimization_profiles > 1:
                    context.set_optimization_profile_async(profile, handle)
                context.set_device_memory(self._scratch.data_ptr(), backend.scratch_bytes)
                values = largest_sizes(backend.spec, b)
                for i in backend.spec.inputs:
                    if not context.set_input_shape(i.name, i.shape(values)):
                        raise EnginesNotRunnable(f"bucket {b}: the engine's profile does not take {i.name} shaped "
                                                 f"{i.shape(values)} (the manifest's largest); rebuild with `trtc "
                                                 "rebuild`")
                    context.set_tensor_address(i.name, self._device_flat[b, i.name].data_ptr())
                flat = {}
                for name in backend.output_names:
                    shape = _shape_of(context.get_tensor_shape(name))
                    if any(d < 0 for d in shape):
                        raise EnginesNotRunnable(f"output {name!r} has a data-dependent shape {shape}; the runtime "
                                                 "needs output shapes that follow from the input shapes")
                    flat[name] = torch.empty(math.prod(shape), dtype=backend.dtypes[name], device=self.device)
                    context.set_tensor_address(name, flat[name].data_ptr())
                state = _TrtBucket(context, flat)
                self._buckets[b] = state
                if not backend.spec.dims:
                    self._set_shapes(b, state, CheckedFeed("numpy", {}, b, {}, ()))
                    if backend.cuda_graphs:
                        state.graph = self._graph_for(b, context, handle)

    def _graph_for(self, bucket: int, context: trt.IExecutionContext, handle: int) -> Any:
        """Warm up and capture ``bucket`` under the compute order; the graph, or None (said once per backend)."""
        backend = self._backend
        launch = _CheckedLaunch(context.execute_async_v3, handle)
        with backend.order.lock:  # after every run queued by the other contexts, as run() orders them
            self.stream.wait_event(backend.order.done)
            captured = capture_graph(self.stream, launch, f"bucket {bucket}")
            backend.order.done.record(self.stream)
        if captured is not None and launch.all_accepted:
            return captured[0]
        if not backend.graph_fallback_said:
            why = ("TensorRT refused an enqueue during warm-up or capture" if not launch.all_accepted
                   else "the capture failed")
            log.warning("bucket %d: %s; running without CUDA graphs (see TensorRT's log above)", bucket, why)
            backend.graph_fallback_said = True
        return None

    def _set_shapes(self, bucket: int, state: _TrtBucket, call: CheckedFeed) -> None:
        values = call_sizes(call, bucket)
        for i in self._spec.inputs:
            state.context.set_input_shape(i.name, i.shape(values))
        state.outputs = {}
        for name, flat in state.outputs_flat.items():
            shape = _shape_of(state.context.get_tensor_shape(name))
            state.outputs[name] = flat[:math.prod(shape)].view(shape)
        state.shape_key = call.key

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        state = self._buckets[bucket]
        if state.graph is not None:
            state.graph.replay()  # on the current stream: run() has made it the context's
            return state.outputs
        if state.shape_key != call.key:
            self._set_shapes(bucket, state, call)
        if not state.context.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"TensorRT failed to enqueue bucket {bucket}; see its log above")
        return state.outputs

    def close(self) -> None:
        super().close()
        self._buckets.clear()  # the TensorRT contexts first: they use the scratch buffer until they go
        self._scratch = None


def tensorrt_backend(directory: Path, manifest: Manifest, spec: ModelSpec, device: str | None,
                      cuda_graphs: bool) -> _TensorRTBackend:
    """The TensorRT backend after the checks ``trtc check`` makes: installed, engines built, none stale on the
    device they will run on (``device``: ``cuda:N``; ``cuda`` or None: the current device), no bfloat16 input.

    Raises ``TensorRTNotInstalled``, ``InputError`` for a device that is not CUDA, or ``EnginesNotRunnable``.
    """
    import torch

    require_tensorrt(directory)  # TensorRTNotInstalled, naming `trtc rebuild DIR`
    if not manifest.engines:
        note = manifest.engines_note or "none were built"
        raise EnginesNotRunnable(f"{directory} has no TensorRT engines ({note}); run `trtc rebuild {directory}` "
                                 "on a machine with TensorRT and a GPU, or load it with backend='onnxruntime'")
    bfloat16 = [i.name for i in spec.inputs if i.dtype == "bfloat16"]
    if bfloat16:  # refused before anything is read: the engine's own types are checked again at load
        raise bfloat16_refusal(directory, bfloat16)
    target = torch.device(device or "cuda")
    if target.type != "cuda":
        raise InputError(f"device={device!r}: TensorRT engines run on a CUDA device")
    if target.index is None:
        target = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    # the GPU that will run them, which on a host with several GPU models need not be device 0's;
    # stale_in hashes every engine: the backend then only reads them
    stale = stale_in(directory, manifest, environment(device=target.index))
    if stale:
        reasons = "; ".join(str(s) for s in stale)
        raise EnginesNotRunnable(f"stale engines in {directory}: {reasons}; run `trtc rebuild {directory}`")
    if not torch.cuda.is_available():
        raise EnginesNotRunnable("TensorRT engines run on a CUDA GPU and torch sees none here; load with "
                                 "backend='onnxruntime' on this machine")
    return _TensorRTBackend(directory, manifest, spec, str(target), cuda_graphs)
