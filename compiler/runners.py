"""One small contract for everything that runs a model: ONNX Runtime, eager PyTorch, TensorRT.

A runner takes a feed dict of numpy arrays and returns a dict of numpy arrays keyed by output
name. Verification, calibration, the accuracy gate, the benchmark harness and the serving
runtime all go through it (as Polygraphy's ``backend/base/runner.py`` does).

``infer`` is ``upload``, ``launch``, ``download`` in one call. The three steps are separate for
timing (``StagedRunner``): ``upload`` copies the feed to the runner's device, ``launch`` runs on
what was uploaded (on CUDA, asynchronously on the caller's current stream, so CUDA events around
it measure device time), ``download`` copies the outputs back to the host and waits for them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from compiler.errors import InputError

__all__ = ["Runner", "StagedRunner", "OrtRunner", "TorchRunner", "CudaGraphRunner", "TrtRunner",
           "check_feed"]

log = logging.getLogger(__name__)


class Runner(Protocol):
    name: str
    input_names: list[str]
    output_names: list[str]

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


class StagedRunner(Runner, Protocol):
    """A runner whose inputs stay on its device between runs: what the benchmark times."""

    device: str  # "cpu" or "cuda"

    def upload(self, feed: dict[str, np.ndarray]) -> None: ...

    def launch(self) -> None: ...

    def download(self) -> dict[str, np.ndarray]: ...


def check_feed(feed: dict[str, np.ndarray], input_names: list[str]) -> None:
    missing = [n for n in input_names if n not in feed]
    extra = [n for n in feed if n not in input_names]
    if missing or extra:
        raise InputError(f"feed does not match the model's inputs {input_names}: missing {missing}, unknown {extra}")


class OrtRunner:
    """ONNX Runtime on an ONNX file (external data beside it) with the given providers."""

    def __init__(self, path: str | Path | Any, providers: list[str] | None = None, threads: int = 0,
                 exact_qdq: bool = False, memory_arena: bool = True) -> None:
        from compiler.onnx_io import ort_session, usable_providers

        self.providers = providers or usable_providers()
        self.session = ort_session(path, self.providers, threads=threads, exact_qdq=exact_qdq,
                                   memory_arena=memory_arena)
        self.name = f"onnxruntime[{self.session.get_providers()[0]}]"
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        gpu = self.session.get_providers()[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
        self.device = "cuda" if gpu else "cpu"
        self._binding: Any = None
        self._feed: dict[str, np.ndarray] = {}
        self._outputs: list[np.ndarray] = []

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_feed(feed, self.input_names)
        outputs = self.session.run(self.output_names, feed)
        return dict(zip(self.output_names, outputs))

    def upload(self, feed: dict[str, np.ndarray]) -> None:
        """On a CUDA provider, copy the feed into device OrtValues bound to the session (IOBinding)."""
        check_feed(feed, self.input_names)
        if self.device == "cpu":
            self._feed = feed
            return
        import onnxruntime as ort

        binding = self.session.io_binding()
        for name in self.input_names:
            value = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(feed[name]), "cuda", 0)
            binding.bind_ortvalue_input(name, value)
        for name in self.output_names:
            binding.bind_output(name, "cuda")
        self._binding = binding

    def launch(self) -> None:
        """Run on the uploaded feed. ONNX Runtime returns once its own CUDA stream is done (host-synchronous)."""
        if self.device == "cpu":
            self._outputs = self.session.run(self.output_names, self._feed)
        else:
            self.session.run_with_iobinding(self._binding)

    def download(self) -> dict[str, np.ndarray]:
        outputs = self._outputs if self.device == "cpu" else self._binding.copy_outputs_to_cpu()
        return dict(zip(self.output_names, outputs))

    def close(self) -> None:
        self._binding = None
        del self.session


class TorchRunner:
    """An eager PyTorch module; outputs are flattened (tuples, dicts) in order and named like the ONNX outputs.

    ``autocast_fp16`` runs under ``torch.autocast`` (CUDA only); outputs come back as float32.
    """

    def __init__(self, module: Any, input_names: list[str], output_names: list[str] | None = None,
                 device: str = "cpu", autocast_fp16: bool = False) -> None:
        import torch

        self.module = module.to(device) if hasattr(module, "to") else module
        self._device = torch.device(device)
        self.device = self._device.type
        self.input_names = input_names
        self.output_names = output_names or []
        self.autocast = autocast_fp16 and self.device == "cuda"
        self.name = "torch" + ("[autocast-fp16]" if self.autocast else "")
        self._args: list[Any] = []
        self._out: Any = None

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        check_feed(feed, self.input_names)
        args = [torch.from_numpy(np.ascontiguousarray(feed[n])).to(self._device) for n in self.input_names]
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16, enabled=self.autocast):
            out = self.module(*args)
        return _named_outputs(out, self.output_names)

    def upload(self, feed: dict[str, np.ndarray]) -> None:
        import torch

        check_feed(feed, self.input_names)
        self._args = [torch.from_numpy(np.ascontiguousarray(feed[n])).to(self._device) for n in self.input_names]

    def launch(self) -> None:
        import torch

        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16, enabled=self.autocast):
            self._out = self.module(*self._args)

    def download(self) -> dict[str, np.ndarray]:
        return _named_outputs(self._out, self.output_names)

    def close(self) -> None:
        self._args, self._out = [], None


def _named_outputs(out: Any, output_names: list[str]) -> dict[str, np.ndarray]:
    """A module's outputs (a tensor, tuple, dict...) flattened in order, on the host, floats as float32."""
    from torch.utils._pytree import tree_flatten

    flat, _ = tree_flatten(out)
    names = output_names or [f"output_{i}" for i in range(len(flat))]
    if len(names) != len(flat):
        raise InputError(f"the model returned {len(flat)} tensors but the ONNX graph has {len(names)} outputs")
    return {n: t.detach().float().cpu().numpy() if t.is_floating_point() else t.detach().cpu().numpy()
            for n, t in zip(names, flat)}


class _CapturedGraph:
    """One CUDA graph with the static tensors it reads and writes."""

    def __init__(self, graph: Any, inputs: list[Any], outputs: Any) -> None:
        self.graph = graph
        self.inputs = inputs
        self.outputs = outputs


class CudaGraphRunner:
    """An eager PyTorch module captured in one CUDA graph per input shape (one per bucket), then replayed.

    The first ``upload`` of a shape warms the module up on a side stream (``warmup_runs`` times, so that
    lazy initialization and cuDNN autotuning happen outside the capture) and captures one forward call;
    later uploads copy into the graph's static input tensors. ``autocast_fp16`` captures under
    ``torch.autocast``. Will not capture models with data-dependent control flow or host synchronization
    (``.item()``, ``nonzero``): torch raises during the capture.
    """

    _side_stream: Any = None

    def __init__(self, module: Any, input_names: list[str], output_names: list[str] | None = None,
                 autocast_fp16: bool = False, warmup_runs: int = 3) -> None:
        import torch

        if not torch.cuda.is_available():
            raise InputError("CUDA graphs need a CUDA GPU, and torch.cuda.is_available() is False here")
        self.module = module.to("cuda")
        self.device = "cuda"
        self.input_names = input_names
        self.output_names = output_names or []
        self.autocast = autocast_fp16
        self.warmup_runs = warmup_runs
        self.name = "torch-cudagraph" + ("[autocast-fp16]" if autocast_fp16 else "")
        self._graphs: dict[tuple[Any, ...], _CapturedGraph] = {}
        self._current: _CapturedGraph | None = None

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.upload(feed)
        self.launch()
        return self.download()

    def upload(self, feed: dict[str, np.ndarray]) -> None:
        import torch

        check_feed(feed, self.input_names)
        key = tuple((feed[n].shape, feed[n].dtype.str) for n in self.input_names)
        if key not in self._graphs:
            self._graphs[key] = self._capture(feed)
        captured = self._graphs[key]
        for name, static in zip(self.input_names, captured.inputs):
            static.copy_(torch.from_numpy(np.ascontiguousarray(feed[name])))
        self._current = captured

    def launch(self) -> None:
        if self._current is None:
            raise InputError("CudaGraphRunner.launch before upload: upload a feed first")
        self._current.graph.replay()

    def download(self) -> dict[str, np.ndarray]:
        if self._current is None:
            raise InputError("CudaGraphRunner.download before upload: upload a feed first")
        return _named_outputs(self._current.outputs, self.output_names)

    def _capture(self, feed: dict[str, np.ndarray]) -> _CapturedGraph:
        import torch

        static = [torch.from_numpy(np.ascontiguousarray(feed[n])).to("cuda") for n in self.input_names]
        if CudaGraphRunner._side_stream is None:  # one for the process: torch keeps a cuBLAS workspace per stream
            CudaGraphRunner._side_stream = torch.cuda.Stream()
        side = CudaGraphRunner._side_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16, enabled=self.autocast):
            with torch.cuda.stream(side):
                for _ in range(self.warmup_runs):
                    self.module(*static)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outputs = self.module(*static)
        log.info("captured a CUDA graph for input shapes %s", [tuple(t.shape) for t in static])
        return _CapturedGraph(graph, static, outputs)

    def close(self) -> None:
        self._graphs.clear()
        self._current = None


class TrtRunner:
    """A serialized TensorRT engine (a file or its bytes), run with TensorRT's Python API on CUDA buffers from torch.

    ``profile`` selects the optimization profile (trtc's multi-profile engines have one per bucket).
    Feeds are converted to the engine's input types; floating outputs come back as float32. ``launch``
    enqueues on the caller's current CUDA stream (``infer`` uses a stream of its own: TensorRT is slow on
    the default stream). Version-compatible engines carry TensorRT's lean runtime as host code, so the
    runtime is allowed to load it: only run engines you built or trust. Outputs whose shape depends on
    the data (``NonZero``) are not supported.
    """

    def __init__(self, engine: str | Path | bytes, profile: int = 0) -> None:
        import tensorrt as trt
        import torch

        from compiler.errors import BuildError

        if not torch.cuda.is_available():
            raise InputError("TensorRT engines need a CUDA GPU, and torch.cuda.is_available() is False here")
        data = engine if isinstance(engine, bytes) else Path(engine).read_bytes()
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        self._runtime.engine_host_code_allowed = True
        loaded = self._runtime.deserialize_cuda_engine(data)
        if loaded is None:
            raise BuildError(f"{engine if not isinstance(engine, bytes) else 'engine'}: TensorRT could not load it "
                             "(built by another TensorRT version or for another GPU?); rebuild it with "
                             "`trtc rebuild DIR`")
        self.engine = loaded
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.input_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        self.device = "cuda"
        self.name = "tensorrt" + (f"[profile {profile}]" if profile else "")
        self._stream = torch.cuda.Stream()
        if profile:
            self.context.set_optimization_profile_async(profile, self._stream.cuda_stream)
            self._stream.synchronize()
        types = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
                 trt.DataType.BF16: torch.bfloat16, trt.DataType.INT8: torch.int8, trt.DataType.UINT8: torch.uint8,
                 trt.DataType.INT32: torch.int32, trt.DataType.INT64: torch.int64, trt.DataType.BOOL: torch.bool}
        engine_types = {n: self.engine.get_tensor_dtype(n) for n in names}
        unknown = [f"{n} ({t})" for n, t in engine_types.items() if t not in types]
        if unknown:
            raise InputError(f"engine inputs/outputs {', '.join(unknown)} have types TrtRunner cannot hold")
        self._dtypes = {n: types[t] for n, t in engine_types.items()}
        self._buffers: dict[str, Any] = {}

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        with torch.cuda.stream(self._stream):
            self.upload(feed)
            self.launch()
            return self.download()

    def upload(self, feed: dict[str, np.ndarray]) -> None:
        import torch

        check_feed(feed, self.input_names)
        for name in self.input_names:
            tensor = torch.from_numpy(np.ascontiguousarray(feed[name])).to("cuda", self._dtypes[name])
            if not self.context.set_input_shape(name, tuple(tensor.shape)):
                raise InputError(f"input {name}: shape {tuple(tensor.shape)} is outside the engine's optimization "
                                 "profile; use the engine built for this batch bucket")
            self.context.set_tensor_address(name, tensor.data_ptr())
            self._buffers[name] = tensor
        for name in self.output_names:
            dims = self.context.get_tensor_shape(name)
            shape = tuple(dims[i] for i in range(len(dims)))
            if any(d < 0 for d in shape):
                raise InputError(f"output {name} has a data-dependent shape {shape}, which TrtRunner does not "
                                 "support")
            buffer = self._buffers.get(name)
            if buffer is None or tuple(buffer.shape) != shape:
                buffer = torch.empty(shape, dtype=self._dtypes[name], device="cuda")
                self._buffers[name] = buffer
            self.context.set_tensor_address(name, buffer.data_ptr())

    def launch(self) -> None:
        import torch

        if not self.context.execute_async_v3(torch.cuda.current_stream().cuda_stream):
            raise RuntimeError("TensorRT's execute_async_v3 failed; its log above says why")

    def download(self) -> dict[str, np.ndarray]:
        out = {n: self._buffers[n] for n in self.output_names}
        return {n: t.float().cpu().numpy() if t.is_floating_point() else t.cpu().numpy() for n, t in out.items()}

    def close(self) -> None:
        self._buffers.clear()
        del self.context
        del self.engine
