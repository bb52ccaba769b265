"""ONNX Runtime's serving backend (its check runner is ``compiler.backends.onnxrt_runner``): the build's ONNX for
the manifest's precision (``model.int8.onnx`` for ``precision: int8``), CUDA or CPU, through an IOBinding on
the preallocated buffers of each context.

On CUDA every context has its own session, created with the context's CUDA stream as ONNX
Runtime's compute stream (``user_compute_stream``): its kernels queue behind the context's input
copies without a host synchronization, and two contexts never share a session's stream, memory
arena or cuDNN handles (with one shared session, concurrent runs of an H200 took 211 ms per batch
instead of 7). cuDNN picks convolution algorithms by heuristic unless ``cuda_options`` says
otherwise (ONNX Runtime's default, an exhaustive search, runs per new shape and stalls the first
calls). TF32 follows ``tf32`` (``use_tf32``), one policy with the other backends.

With ``cuda_graphs``, on CUDA, each context's run of every bucket is captured at load in a CUDA
graph by torch, around ONNX Runtime's run on the context's stream, and replayed from then on:
without one, the run holds the calling thread while it launches every kernel (on an H200 about as
long as the GPU computes them), so a second buffer set had little to overlap. The session is made
with ``enable_cuda_graph``, so that ONNX Runtime checks the model can be captured (every compute
node on CUDA, no copies between host and device in the graph) and frees its host scratch buffers
without host callbacks, which a graph would replay; its own capture stays off (``gpu_graph_id``
-1): its replay waits for the GPU on the host. Only models whose only dynamic dimension is the batch
are captured, and all of a context's buckets or none: ONNX Runtime's kernels keep device state
between runs that the next shape's run may free or rewrite (its fused convolution without a bias
reallocates a zero bias per input shape), so after load nothing but the graphs may run on the
session. A model with such a convolution (and no other dynamic dimension) is served on CUDA at its
largest bucket only, every batch padded to it: one shape per session, so its runs are captured and
never reallocate (a session that ran a small batch between full ones paid the reallocation, which
waits for the whole device, at every change of shape). Every graph is
checked at the end of the load by replaying it alone against the outputs of ONNX Runtime's own
run; a model ONNX Runtime refuses, or a capture that fails or does not reproduce its run, runs
without graphs (in a session made without ``enable_cuda_graph``).

Without graphs, every bucket runs once at load on the context's launcher thread (ONNX Runtime's first run of a
shape, and its first run on a thread, set up what later runs reuse), and ``start`` (what the batchers call, and
``map`` with two contexts or more) packs the batch on the caller's thread and hands the rest (the copies, ONNX
Runtime's run and the copy back, queued on the stream) to that thread, so that the caller (a batcher's one thread)
reads and answers requests while ONNX Runtime launches the kernels. On an H200 that launch took the process
batcher's thread about 7 us per request of a small transformer's batches, as much as all of its own work.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from compiler.backends.base import Context, call_sizes, largest_sizes, remember
from compiler.backends.feeds import NUMPY_DTYPES, CheckedFeed
from compiler.backends.gpu import ComputeOrder, GpuContext, capture_graph
from compiler.backends.host import HostContext
from compiler.core.errors import InputError, first_line
from compiler.core.specs import BATCH_DIM, ModelSpec

if TYPE_CHECKING:
    import torch

__all__ = ["OrtBackend", "OrtCpuContext", "OrtCudaContext", "CUDA_OPTIONS", "ORDER_RUNS"]

log = logging.getLogger(__name__)

# CUDA provider options every context gets (``cuda_options`` adds to or overrides them)
CUDA_OPTIONS = {"cudnn_conv_algo_search": "HEURISTIC", "cudnn_conv_use_max_workspace": "1"}
# Whether the runs of a backend's CUDA contexts that launch every kernel from the host (no CUDA graphs) go to the GPU
# one after the other (``ComputeOrder``). Off: on an H200 ordering won 15-20 % for a CNN with two concurrent callers
# but lost 30 % for a transformer, and behind a batcher with 64 client threads it collapsed (489 req/s against
# 3,302): the thread that runs it holds the order across ONNX Runtime's run, which releases the GIL, and then waits
# for the GIL with the order held. Contexts whose runs are CUDA graph replays are ordered, as TensorRT's and torch's
# are: a replay holds the order for microseconds, and two contexts' batches side by side on the GPU both finished
# late (an H200, torchvision's ResNet-50: ``ProcessBatcher`` with two contexts at p99 48 ms against 15.7 ms with
# one).
ORDER_RUNS = False



class OrtBackend:
    name = "onnxruntime"

    def __init__(self, path: Path, spec: ModelSpec, buckets: Sequence[int], device: str | None, threads: int,
                 tf32: bool = True, cuda_options: Mapping[str, str] | None = None, cuda_graphs: bool = True) -> None:
        from compiler.core.capabilities import ort_providers
        from compiler.core.onnx_io import ort_session

        self.spec = spec
        self.graphs_refused = False  # ONNX Runtime refused graph capture for this model (said once)
        self.buckets = tuple(buckets)
        self.path = path
        self.threads = threads
        self.tf32 = tf32
        self.cuda_options = {**CUDA_OPTIONS, "use_tf32": "1" if tf32 else "0", **(cuda_options or {})}
        if device is None:
            providers = ort_providers(["CUDAExecutionProvider", "CPUExecutionProvider"])
        elif device == "cpu":
            providers = ["CPUExecutionProvider"]
        else:
            providers = ort_providers(["CUDAExecutionProvider", "CPUExecutionProvider"])
            if providers[0] != "CUDAExecutionProvider":
                raise InputError(f"device={device!r}: ONNX Runtime has no usable CUDA provider here (install "
                                 "onnxruntime-gpu on a machine with a GPU), or pass device='cpu'")
            if device not in ("cuda", "cuda:0"):
                raise InputError(f"device={device!r}: ONNX Runtime serving runs on cuda:0; select the GPU with "
                                 "CUDA_VISIBLE_DEVICES")
        import onnx
        from onnx.helper import tensor_dtype_to_np_dtype

        model = onnx.load(str(path), load_external_data=False)
        graph = model.graph
        initializers = {i.name for i in graph.initializer}
        names = [i.name for i in graph.input if i.name not in initializers]
        if sorted(names) != sorted(spec.input_names):
            raise InputError(f"{path} takes inputs {names}, the manifest declares {spec.input_names}; rebuild the "
                             "directory")
        self.provider = providers[0] if providers[0] == "CUDAExecutionProvider" else "CPUExecutionProvider"
        self.device = "cuda:0" if self.provider == "CUDAExecutionProvider" else "cpu"
        # on the CPU the contexts share one session (its runs are independent); on CUDA each context has its own
        self.session: Any = None
        if self.device == "cpu":
            try:
                self.session = ort_session(path, ["CPUExecutionProvider"], threads=threads)
            except Exception as err:  # onnxruntime's pybind errors share no narrower base class
                raise InputError(f"{path}: ONNX Runtime cannot load it ({first_line(err)}); rebuild the directory "
                                 "with this trtc, whose calibration writes only files that load") from err
        self.order = ComputeOrder() if self.device != "cpu" and ORDER_RUNS else None
        self._replay_order: ComputeOrder | None = None  # the graph-replaying contexts' order (``replay_order``)
        self.output_names = [o.name for o in graph.output]
        self.output_dtypes = {o.name: tensor_dtype_to_np_dtype(o.type.tensor_type.elem_type) for o in graph.output}
        self._output_dims: dict[str, list[int | str | None]] = {
            o.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                     for d in o.type.tensor_type.shape.dim] for o in graph.output}
        known = {BATCH_DIM, *spec.dims}
        self.outputs_resolvable = all(
            isinstance(d, int) or d in known for dims in self._output_dims.values() for d in dims) and all(
            dims and dims[0] == BATCH_DIM for dims in self._output_dims.values())
        if self.device != "cpu" and not spec.dims and len(self.buckets) > 1 and _conv_without_bias(model):
            # its fused convolution reallocates a zero bias whenever the session's input shape changes (cudaFree,
            # which waits for the whole device), and no two buckets' CUDA graphs can share the session: every batch
            # runs at the largest bucket, one shape per session, so its runs are captured (and never reallocate)
            log.info("%s: a convolution without a bias keeps per-shape state in ONNX Runtime's CUDA kernels; "
                     "serving every batch at bucket %d (buckets %s)", path.name, max(self.buckets),
                     ",".join(map(str, self.buckets)))
            self.buckets = (max(self.buckets),)
        # what CUDA graphs need (the module docstring): fixed shapes per bucket, outputs in our buffers, and no
        # kernel whose device state one bucket's run frees under another's graph
        self.capturable = (cuda_graphs and self.outputs_resolvable and not spec.dims
                           and (len(self.buckets) == 1 or not _conv_without_bias(model)))

    def _providers(self, first: str, stream: Any, graphs: bool = False) -> list[Any]:
        """The providers for a session: CUDA with this backend's options (and ``stream`` as its compute stream,
        ``graphs``: checked for graph capture)."""
        if first != "CUDAExecutionProvider":
            return ["CPUExecutionProvider"]
        options = dict(self.cuda_options)
        if stream is not None:
            options["user_compute_stream"] = str(stream.cuda_stream)
        if graphs:
            options["enable_cuda_graph"] = "1"
        return [("CUDAExecutionProvider", options), "CPUExecutionProvider"]

    def context_session(self, stream: Any, graphs: bool | None = None) -> tuple[Any, bool, bool]:
        """A CUDA session of its own for one context, computing on ``stream``: (session, whether it does, whether
        its runs may be captured in CUDA graphs). ``graphs=False``: a session made without graph capture in mind
        (the context's captures failed).

        An ONNX Runtime that refuses ``user_compute_stream`` gets a session on its own stream; the
        context then waits for its copies on the host before each run, and captures no graphs.
        """
        from compiler.core.onnx_io import ort_session

        # One CPU thread that sleeps when idle (unless ``threads`` says otherwise): the CUDA provider's kernels run on
        # the GPU, and a pool per context of one thread per core, spinning after each CPU node, took the cores from
        # the server's threads (the batcher's workers waited for the GIL behind them).
        threads = self.threads or 1
        session = None
        if graphs is None:
            graphs = self.capturable and not self.graphs_refused
        if graphs:
            try:
                session = ort_session(self.path, self._providers(self.provider, stream, graphs=True), threads=threads,
                                      spinning=False)
            except Exception as err:  # onnxruntime's pybind errors share no narrower base class
                self.graphs_refused = True
                log.info("ONNX Runtime made no session for CUDA graph capture of %s (%s); its runs launch every "
                         "kernel from the host", self.path.name, first_line(err))
                graphs = False
        try:
            if session is None:
                session = ort_session(self.path, self._providers(self.provider, stream), threads=threads,
                                      spinning=False)
            own = True
        except Exception as err:
            log.warning("ONNX Runtime does not take the context's CUDA stream (%s); its runs wait for the copies "
                        "on the host", first_line(err))
            session, own, graphs = ort_session(self.path, self._providers(self.provider, None), threads=threads,
                                               spinning=False), False, False
        if session.get_providers()[0] != "CUDAExecutionProvider":
            raise InputError(f"{self.path}: ONNX Runtime could not start its CUDA provider (see its log above); "
                             "check the CUDA and cuDNN libraries onnxruntime-gpu needs, or load with device='cpu'")
        return session, own, graphs

    def output_shape(self, name: str, values: dict[str, int]) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else values[str(d)] for d in self._output_dims[name])

    def largest_outputs(self, bucket: int) -> dict[str, tuple[int, Any]]:
        """(element count, numpy dtype) of every output at the bucket's largest shapes: the buffers to allocate."""
        values = largest_sizes(self.spec, bucket)
        return {name: (math.prod(self.output_shape(name, values)), self.output_dtypes[name])
                for name in self.output_names}

    def new_context(self) -> Context:
        if self.device == "cpu":
            return OrtCpuContext(self)
        return OrtCudaContext(self)

    def replay_order(self) -> ComputeOrder:
        """The order the runs of this backend's graph-replaying contexts take on the GPU (see ``ORDER_RUNS``)."""
        if self._replay_order is None:
            self._replay_order = ComputeOrder()
        return self._replay_order

    def close(self) -> None:
        self.session = None


def _conv_without_bias(model: Any) -> bool:
    """Whether a convolution has no bias input, in the graph, its subgraphs or its functions: ONNX Runtime's CUDA
    kernel for it fused with its activation allocates a zero bias per input shape, freeing the last one
    (``cudaFree``), which a graph captured at another shape still reads."""
    from compiler.core.onnx_io import subgraphs

    def nodes(graph: Any) -> Any:
        for node in graph.node:
            yield node
            for sub in subgraphs(node):
                yield from nodes(sub)

    every = [*nodes(model.graph), *(n for f in model.functions for n in nodes(f))]
    return any(n.op_type in ("Conv", "ConvTranspose") and (len(n.input) < 3 or not n.input[2]) for n in every)


@dataclass
class OrtBinding:
    binding: Any  # onnxruntime.IOBinding
    inputs: list[tuple[str, np.ndarray, bool]]  # as ``input_views`` gives them
    outputs: dict[str, np.ndarray] | None  # preallocated outputs; None: ONNX Runtime allocates them
    keep: list[Any] = field(default_factory=list)  # OrtValues bound by pointer


class OrtCpuContext(HostContext):
    """ONNX Runtime on the CPU: one IOBinding per bucket (and dynamic sizes) over preallocated arrays."""

    def __init__(self, backend: OrtBackend) -> None:
        super().__init__(backend.spec, backend.buckets)
        self._backend = backend
        self._out_flat: dict[tuple[int, str], np.ndarray] = {}
        if backend.outputs_resolvable:
            for b in backend.buckets:
                for name, (numel, dtype) in backend.largest_outputs(b).items():
                    self._out_flat[b, name] = np.zeros(numel, dtype)
        self._bindings: dict[tuple[int, tuple[int, ...]], OrtBinding] = {}
        self._run_bound = backend.session.run_with_iobinding

    def run(self, bucket: int, call: CheckedFeed, start: int, stop: int, host: bool) -> None:
        """``HostContext.run`` with the binding's views: one lookup per call (this is the CPU hot path)."""
        entry = self._bindings.get((bucket, call.key)) or self._binding(bucket, call)
        rows = stop - start
        whole = rows == call.rows
        arrays = call.arrays
        for name, view, batched in entry.inputs:
            if batched:
                view[:rows] = arrays[name] if whole else arrays[name][start:stop]
            else:
                view[...] = arrays[name]
        self._run_bound(entry.binding)
        self._last = entry.outputs if entry.outputs is not None else self._allocated(entry)
        self._rows = rows

    def _allocated(self, entry: OrtBinding) -> dict[str, np.ndarray]:
        return dict(zip(self._backend.output_names, entry.binding.copy_outputs_to_cpu()))

    def _binding(self, bucket: int, call: CheckedFeed) -> OrtBinding:
        entry = self._bindings.get((bucket, call.key))
        if entry is not None:
            return entry
        import onnxruntime as ort

        session = self._backend.session
        binding = session.io_binding()
        keep: list[Any] = []
        inputs = self.input_views(bucket, call)
        for name, view, _ in inputs:
            value = ort.OrtValue.ortvalue_from_numpy(view)
            binding.bind_ortvalue_input(name, value)
            keep.append(value)
        outputs: dict[str, np.ndarray] | None = None
        if self._backend.outputs_resolvable:
            values = call_sizes(call, bucket)
            outputs = {}
            for name in self._backend.output_names:
                shape = self._backend.output_shape(name, values)
                outputs[name] = self._out_flat[bucket, name][:math.prod(shape)].reshape(shape)
                value = ort.OrtValue.ortvalue_from_numpy(outputs[name])
                binding.bind_ortvalue_output(name, value)
                keep.append(value)
        else:
            for name in self._backend.output_names:
                binding.bind_output(name, "cpu")
        entry = OrtBinding(binding, inputs, outputs, keep)
        remember(self._bindings, (bucket, call.key), entry)
        return entry

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        entry = self._binding(bucket, call)
        self._run_bound(entry.binding)
        return entry.outputs if entry.outputs is not None else self._allocated(entry)

    def close(self) -> None:
        super().close()
        self._bindings.clear()
        self._out_flat.clear()


class _Handoff:
    """One buffer set's runs handed to its context's launcher thread (one per context, shared by its sets, so that
    their runs reach the stream in the order handed), and the wait for the last one."""

    def __init__(self, launcher: ThreadPoolExecutor) -> None:
        self._launcher = launcher
        self._job: Future[None] | None = None

    def give(self, job: Callable[[], None]) -> None:
        """Hand ``job`` to the launcher thread; run it on this thread once the interpreter is shutting down
        (``concurrent.futures`` takes no new work then, while a server's own thread may still serve)."""
        try:
            self._job = self._launcher.submit(job)
        except RuntimeError:
            self._job = None
            job()

    def wait(self) -> None:
        """Wait for the last job; its error is raised here."""
        if self._job is not None:
            self._job.result()

    def settle(self) -> None:
        """Wait for the last job, whose caller is gone (interrupted): its error is nobody's."""
        if self._job is not None:
            futures_wait([self._job])
            self._job = None

    def done(self) -> bool:
        return self._job is None or self._job.done()


class OrtCudaContext(GpuContext):
    """ONNX Runtime's CUDA provider on device buffers bound by pointer, in a session of the context's own that
    computes on the context's stream. Its run only queues the kernels (no synchronization at the end of the
    run) when the session computes on our stream into our buffers; otherwise it returns when the stream is
    done. With CUDA graphs (the module docstring) a run is a replay of the bucket's graph, and the replays of the
    backend's contexts reach the GPU one after the other; runs that launch every kernel are not ordered (see
    ``ORDER_RUNS``): the GPU interleaves them."""

    launches_on_host = True  # without CUDA graphs its run launches every kernel; set per context below

    def __init__(self, backend: OrtBackend) -> None:
        import torch

        super().__init__(backend.spec, backend.buckets, backend.device, None, None)
        self._backend = backend
        self._session, self._on_our_stream, graphs = backend.context_session(self.stream)
        self._out_flat: dict[tuple[int, str], torch.Tensor] = {}
        if backend.outputs_resolvable:
            for b in backend.buckets:
                for name, (numel, np_dtype) in backend.largest_outputs(b).items():
                    dtype = torch.from_numpy(np.empty(0, np_dtype)).dtype
                    self._out_flat[b, name] = torch.empty(numel, dtype=dtype, device=self.device)
        self._bindings: dict[tuple[int, tuple[int, ...]], tuple[Any, dict[str, Any] | None]] = {}
        self._queue_only = self._run_options(graphs)
        self._order = backend.order  # None unless ORDER_RUNS
        self._graphs: dict[int, tuple[Any, dict[str, Any]]] = {}  # bucket -> (its run's graph, outputs); all or none
        if graphs:  # on our stream into our buffers (``capturable``): its runs only queue their kernels
            self._graphs = self._captured_all()
            if not self._graphs:  # a session that captures nothing should not pay for graph capture in its runs
                self._session, self._on_our_stream, _ = backend.context_session(self.stream, graphs=False)
                self._bindings.clear()
                self._queue_only = self._run_options(False)
        self.launches_on_host = not self._graphs
        if self._graphs and self._order is None:
            self._order = backend.replay_order()
        # without graphs, ``start``'s run is queued on the stream by this thread (the module docstring); shared by
        # the buffer sets (``lane`` copies the attribute), so their runs reach the stream in the order started
        self._launcher = ThreadPoolExecutor(1, thread_name_prefix="trtc-ort-launch") if not self._graphs else None
        self._handoff = _Handoff(self._launcher) if self._launcher is not None else None  # this set's
        self.start_hands_off = self._launcher is not None
        if self._launcher is not None:  # graphs were warmed up by their capture
            self._launcher.submit(self._warm_up).result()

    def _warm_up(self) -> None:
        """Run every bucket once at load, on the launcher thread, at the largest dynamic sizes: ONNX Runtime's first
        run of a shape picks its kernels' algorithms and grows its memory arena, and its first run on a thread makes
        that thread's CUDA library handles; none of that may land on a request (the first batch of each size
        stalled every caller behind it)."""
        torch = self._torch
        sizes = {name: r.max for name, r in self._spec.dims.items()}
        key = tuple(sizes[name] for name in self._spec.dims)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for bucket in self._backend.buckets:
                self.execute(bucket, CheckedFeed("numpy", {}, bucket, sizes, key))
        self.stream.synchronize()

    def lane(self) -> GpuContext:
        other = super().lane()
        assert isinstance(other, OrtCudaContext)
        other._handoff = _Handoff(self._launcher) if self._launcher is not None else None
        return other

    def start(self, bucket: int, calls: Sequence[CheckedFeed], out: Mapping[str, np.ndarray] | None = None) -> None:
        handoff = self._handoff
        if handoff is None:
            super().start(bucket, calls, out)
            return
        if not handoff.done():  # a run never waited for (its caller was interrupted) still reads this set's buffers
            handoff.settle()
            super().wait()
        views = self._pack_parts(bucket, calls)  # into this set's staging, on the caller's thread
        handoff.give(functools.partial(self._queue_parts, bucket, calls[0], views, out))

    def _queue_parts(self, bucket: int, call: CheckedFeed, views: dict[str, Any],
                     out: Mapping[str, np.ndarray] | None) -> None:
        """On the launcher: what ``GpuContext.start`` queues after the pack, under the same lock."""
        torch = self._torch
        with self._queueing, torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self._copy_parts(views)
            self._compute(bucket, call)
            self._download(True, None, out)

    def wait(self) -> None:
        if self._handoff is not None:
            self._handoff.wait()  # ONNX Runtime's error, if its run failed, is the caller's
        super().wait()

    def ready(self) -> bool:
        return (self._handoff is None or self._handoff.done()) and super().ready()

    def _run_options(self, graphs: bool) -> Any:
        """On our stream with outputs in our own buffers, the run only queues its kernels: ONNX Runtime does not
        wait for the stream at the end of the run, so the host is free while the GPU computes (map overlaps the
        next batch's copy with this one's compute) and ``wait`` is the one synchronization, as with TensorRT.
        None otherwise (the run returns when the stream is done)."""
        if not (self._on_our_stream and self._backend.outputs_resolvable):
            return None
        import onnxruntime as ort

        options = ort.RunOptions()
        options.add_run_config_entry("disable_synchronize_execution_providers", "1")
        if graphs:  # ONNX Runtime's own capture stays off: torch captures the run (the module docstring)
            options.add_run_config_entry("gpu_graph_id", "-1")
        return options

    def _binding(self, bucket: int, call: CheckedFeed) -> tuple[Any, dict[str, Any] | None]:
        """The IOBinding of the bucket's buffers at the call's shape, and the output views it writes."""
        backend = self._backend
        entry = self._bindings.get((bucket, call.key))
        if entry is None:
            binding = self._session.io_binding()
            index = self.device.index or 0
            inputs = self.device_inputs(bucket, call)
            for i in backend.spec.inputs:
                view = inputs[i.name]
                binding.bind_input(i.name, "cuda", index, NUMPY_DTYPES[i.dtype], tuple(view.shape), view.data_ptr())
            outputs: dict[str, Any] | None = None
            if backend.outputs_resolvable:
                values = call_sizes(call, bucket)
                outputs = {}
                for name in backend.output_names:
                    shape = backend.output_shape(name, values)
                    outputs[name] = self._out_flat[bucket, name][:math.prod(shape)].view(shape)
                    binding.bind_output(name, "cuda", index, backend.output_dtypes[name], shape,
                                        outputs[name].data_ptr())
            else:
                for name in backend.output_names:
                    binding.bind_output(name, "cuda", index)
            entry = (binding, outputs)
            remember(self._bindings, (bucket, call.key), entry)
        return entry

    def _captured_all(self) -> dict[int, tuple[Any, dict[str, Any]]]:
        """Every bucket's run captured in a CUDA graph (warmed up first), then each graph replayed alone, newest
        first, against the outputs of ONNX Runtime's own run before its capture: the graphs, or none when one
        capture fails or a replay does not reproduce its run."""
        import torch

        name = self._backend.path.name
        captured: list[tuple[int, Any, dict[str, Any], dict[str, Any]]] = []
        for bucket in self._backend.buckets:
            binding, outputs = self._binding(bucket, CheckedFeed("numpy", {}, bucket, {}, ()))
            assert outputs is not None  # ``capturable``: the outputs are our buffers
            capture = capture_graph(self.stream, functools.partial(self._session.run_with_iobinding, binding,
                                                              self._queue_only), f"{name}: bucket {bucket}")
            if capture is None:
                return {}
            with torch.cuda.stream(self.stream):  # capture runs nothing: the outputs are the last warm-up's
                expected = {key: out.clone() for key, out in outputs.items()}
            captured.append((bucket, capture[0], outputs, expected))
        for bucket, graph, outputs, expected in reversed(captured):
            if not self._replays(graph, outputs, expected):
                log.warning("%s: bucket %d: the CUDA graph does not reproduce ONNX Runtime's run; running without "
                            "graphs", name, bucket)
                return {}
        return {bucket: (graph, outputs) for bucket, graph, outputs, _ in captured}

    def _replays(self, graph: Any, outputs: dict[str, Any], expected: dict[str, Any]) -> bool:
        """Whether replaying ``graph`` alone writes ``expected`` into ``outputs`` (overwritten first with every
        byte inverted, so that an output the graph does not write fails). Outputs that are not all finite cannot
        be told apart from garbage: they fail too."""
        import torch

        with torch.cuda.stream(self.stream):
            for out in outputs.values():
                out.view(torch.uint8).bitwise_not_()
            graph.replay()
        self.stream.synchronize()
        for key, out in outputs.items():
            want = expected[key]
            if want.is_floating_point():
                if not bool(torch.isfinite(want).all()) or not torch.allclose(out, want, rtol=1e-3, atol=1e-5):
                    return False
            elif not torch.equal(out, want):
                return False
        return True

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        import torch

        captured = self._graphs.get(bucket)
        if captured is not None:
            captured[0].replay()  # on the current stream: run() has made it the context's
            return captured[1]
        binding, outputs = self._binding(bucket, call)
        if not self._on_our_stream:
            self.stream.synchronize()  # the inputs were copied on our stream; ONNX Runtime reads them on its own
        if self._queue_only is not None:
            self._session.run_with_iobinding(binding, self._queue_only)  # returns once the kernels are queued
        else:
            self._session.run_with_iobinding(binding)  # returns when the stream is done
        if outputs is not None:
            return outputs
        return {name: torch.from_numpy(a).to(self.device)
                for name, a in zip(self._backend.output_names, binding.copy_outputs_to_cpu())}

    def close(self) -> None:
        if self._launcher is not None:
            self._launcher.shutdown(wait=True)
        super().close()
        self._graphs.clear()
        self._bindings.clear()
        self._out_flat.clear()
        self._session = None
