"""The serving runtime: ``engines = compiler.load(DIR)``, then ``engines(x)`` or ``engines.map(batches, fn)``.

One call goes through these stages: check the feed against the manifest's input spec (names,
dtypes, fixed sizes, ranges of dynamic sizes), route the batch to the smallest bucket that holds
it (a batch over the largest bucket runs in chunks of the largest), copy it into that bucket's
preallocated input buffers, run, and copy the real rows of every output out. Padding rows keep
whatever the buffer held: every row is computed on its own, so they never reach a result.

Backends, behind one small interface (a backend makes contexts; a context owns one execution
context plus input and output buffers for every bucket):

* ``tensorrt``: the directory's engines. ``execute_async_v3`` on the context's CUDA stream, tensor
  addresses bound once per buffer (torch tensors are the device buffers), pinned host buffers for
  the copies, and one CUDA graph per bucket, captured after warm-up, when no input has a dynamic
  non-batch dimension (a graph is only valid for the shapes it was captured with).
* ``onnxruntime``: the build's ONNX for the manifest's precision (``model.int8.onnx`` for
  ``precision: int8``), CUDA or CPU, through an IOBinding on the preallocated buffers.
* ``torch``: the source model in eager PyTorch, with a CUDA graph per bucket on a GPU. For nodes
  with neither TensorRT nor a usable ONNX, and to measure the runtime itself.

``backend="auto"`` is TensorRT when it is installed, else ONNX Runtime, and then it says so once
in a log line, so that a service still starts on a node without TensorRT.

Thread safety: an ``Engines`` may be called from any number of threads. Each call borrows one
context from a small pool (``contexts``, default 2; created on demand, the first at load) and
gives it back when its outputs are copied out; callers beyond the pool wait for a free context.
A context is never used by two callers at once, so its buffers and stream are never shared.
"""

from __future__ import annotations

import functools
import logging
import math
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from compiler.errors import InputError, TrtcError
from compiler.specs import BATCH_DIM, DimRange, InputSpec, ModelSpec, parse_dim_range, parse_input_spec

if TYPE_CHECKING:
    import tensorrt as trt
    import torch

__all__ = ["load", "engines_from_module", "onnx_for_precision", "tensorrt_available", "Engines", "CheckedFeed",
           "FeedError", "EnginesNotRunnable", "BACKENDS"]

log = logging.getLogger(__name__)

BACKENDS = ("auto", "tensorrt", "onnxruntime", "torch")
_NUMPY_DTYPES: dict[str, Any] = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32,
                                 "int8": np.int8, "uint8": np.uint8, "bool": np.bool_, "bfloat16": None}
_BINDING_CACHE = 32  # (bucket, dynamic sizes) combinations whose views and bindings a context keeps
_PARALLEL_COPY_BYTES = 1 << 20  # inputs this large are staged with torch's multi-threaded copy


class FeedError(InputError, ValueError):
    """A feed that does not match the model: a missing or unknown input, a wrong dtype, rank or size."""


class EnginesNotRunnable(TrtcError):
    """The directory's TensorRT engines cannot run here (none built, stale, unreadable)."""

    exit_code = 1


# --- the feed ----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _InputCheck:
    """One input's contract, laid out for a fast check: fixed sizes and dynamic dims by axis."""

    name: str
    dims: tuple[int | str, ...]
    dtype: str
    np_dtype: Any  # numpy dtype, None for bfloat16 (torch tensors only)
    batched: bool
    fixed: tuple[tuple[int, int], ...]  # (axis, size)
    dynamic: tuple[tuple[int, str], ...]  # (axis, dimension name), the batch excluded


@dataclass
class CheckedFeed:
    """A feed checked against the spec (``Engines.check``): what one ``engines(...)`` runs."""

    kind: str  # what the outputs become: "numpy", "torch" (CPU tensors) or "cuda" (CUDA tensors)
    arrays: dict[str, Any]  # numpy arrays, or CUDA tensors when ``on_device``
    rows: int
    dims: dict[str, int]  # sizes of the non-batch dynamic dimensions
    key: tuple[int, ...]  # the same sizes, in spec order: a cache key
    on_device: bool = False
    device: Any = None  # the torch device of a CUDA feed


def _checks_for(spec: ModelSpec) -> list[_InputCheck]:
    checks = []
    for i in spec.inputs:
        if BATCH_DIM in i.dims[1:]:
            raise InputError(f"input {i}: the runtime batches along the first dimension, and B is not first; "
                             "re-export with the batch first")
        fixed = tuple((axis, d) for axis, d in enumerate(i.dims) if isinstance(d, int))
        dynamic = tuple((axis, d) for axis, d in enumerate(i.dims) if isinstance(d, str) and d != BATCH_DIM)
        checks.append(_InputCheck(i.name, i.dims, i.dtype, _NUMPY_DTYPES[i.dtype],
                                  bool(i.dims) and i.dims[0] == BATCH_DIM, fixed, dynamic))
    if not any(c.batched for c in checks):
        raise InputError(f"no input has the batch dimension B first ({', '.join(map(str, spec.inputs))}); the "
                         "runtime serves batched models: re-export with --input NAME:Bx...")
    return checks


def _array_of(value: Any, check: _InputCheck) -> tuple[str, Any]:
    """("numpy" | "torch" | "cuda", the array to run): numpy arrays and CPU tensors as numpy, CUDA tensors as is."""
    if isinstance(value, np.ndarray):
        if value.dtype != check.np_dtype:
            how = f"x.astype(np.{check.dtype})" if check.np_dtype is not None else "a torch.bfloat16 tensor"
            raise FeedError(f"input {check.name!r} has dtype {value.dtype}, the model takes {check.dtype}: pass {how}")
        return "numpy", value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        want = getattr(torch, check.dtype)
        if value.dtype != want:
            raise FeedError(f"input {check.name!r} has dtype {value.dtype}, the model takes {want}: pass x.to({want})")
        if value.requires_grad:
            value = value.detach()
        if value.is_cuda:
            return "cuda", value
        return "torch", value.numpy()
    raise FeedError(f"input {check.name!r} is a {type(value).__name__}; pass a numpy array or a torch tensor")


# --- what backends provide ----------------------------------------------------------------------------------------

class _Context(Protocol):
    """One execution context with input and output buffers for every bucket; one caller at a time.

    ``run`` copies rows ``start:stop`` of the call into the bucket's buffers and starts the work
    (asynchronous on a GPU: copies and compute are queued on the context's stream); ``wait`` blocks
    until it is done. ``outputs`` are views of the last run's real rows: host numpy arrays when
    ``run`` was asked for ``host`` outputs (valid after ``wait``), else device tensors usable on
    the context's stream. ``execute`` is the bare model run on buffers already filled (benchmarks).
    """

    on_gpu: bool

    def run(self, bucket: int, call: CheckedFeed, start: int, stop: int, host: bool) -> None: ...

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]: ...

    def wait(self) -> None: ...

    def outputs(self) -> dict[str, Any]: ...

    def copy_outputs(self) -> dict[str, np.ndarray]: ...

    def copy_outputs_on_device(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


class _Backend(Protocol):
    name: str
    device: str
    spec: ModelSpec
    buckets: tuple[int, ...]
    output_names: list[str]

    def new_context(self) -> _Context: ...

    def close(self) -> None: ...


def _max_values(spec: ModelSpec, bucket: int) -> dict[str, int]:
    values = {name: r.max for name, r in spec.dims.items()}
    values[BATCH_DIM] = bucket
    return values


def _call_values(call: CheckedFeed, bucket: int) -> dict[str, int]:
    values = dict(call.dims)
    values[BATCH_DIM] = bucket
    return values


# --- the front end ------------------------------------------------------------------------------------------------

class Engines:
    """A build directory's engines, ready to serve. Made by ``load`` (or ``engines_from_module``).

    ``engines(x)`` takes one array (single-input models) and returns one array (single-output
    models; a dict by output name otherwise); ``engines({"name": x, ...})`` returns a dict. Arrays
    are numpy arrays or torch tensors (CPU or CUDA, all inputs alike) and outputs come back as
    the same kind, on the same device. The first dimension is the batch, any size from 1.

    Safe to call from many threads: see the module docstring. Close it (or use ``with``) to free
    the contexts and their buffers.
    """

    def __init__(self, backend: _Backend, contexts: int = 2) -> None:
        if contexts < 1:
            raise InputError(f"contexts={contexts}: an Engines needs at least one execution context")
        self._backend = backend
        self.spec: ModelSpec = backend.spec
        self.buckets: tuple[int, ...] = tuple(sorted(backend.buckets))
        self.output_names: list[str] = list(backend.output_names)
        self.input_names: list[str] = backend.spec.input_names
        self.name = f"trtc-runtime[{backend.name}]"  # as a ``compiler.runners.Runner``
        self._checks = _checks_for(backend.spec)
        self._dim_names = tuple(backend.spec.dims)
        self._largest = largest = self.buckets[-1]
        self._sole_output = self.output_names[0] if len(self.output_names) == 1 else None
        # smallest bucket holding n rows, for n = 1 .. largest
        self._route = [0] + [next(b for b in self.buckets if b >= n) for n in range(1, largest + 1)]
        self._idle: queue.SimpleQueue[_Context] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._max_contexts = contexts
        self._contexts: list[_Context] = [backend.new_context()]  # the first now: errors and graph capture at load
        self._idle.put(self._contexts[0])
        self._closed = False

    @property
    def backend(self) -> str:
        """``tensorrt``, ``onnxruntime`` or ``torch``."""
        return self._backend.name

    @property
    def device(self) -> str:
        """Where the model runs: ``cpu`` or ``cuda:N``."""
        return self._backend.device

    @property
    def inputs(self) -> tuple[InputSpec, ...]:
        return self.spec.inputs

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``engines(feed)``: the ``Runner`` contract, so the harness can run the serving path itself."""
        outputs: dict[str, np.ndarray] = self(dict(feed))
        return outputs

    def __repr__(self) -> str:
        return (f"Engines(backend={self.backend!r}, device={self.device!r}, inputs={[str(i) for i in self.inputs]}, "
                f"outputs={self.output_names}, buckets={list(self.buckets)})")

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Free every context and the backend; waits for calls in flight to give their contexts back."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            contexts = list(self._contexts)
        for _ in contexts:
            self._idle.get().close()
        self._backend.close()

    # -- calls --

    def __call__(self, x: Any) -> Any:
        single = type(x) is np.ndarray or (type(x) is not dict and not isinstance(x, Mapping))
        call = self._check(x, single)
        if call.rows <= self._largest and not call.on_device:  # the common case, inlined: one bucket, host memory
            context = self._acquire()
            try:
                context.run(self._route[call.rows], call, 0, call.rows, True)
                context.wait()
                outputs: dict[str, Any] = context.copy_outputs()
            finally:
                self._idle.put(context)
            if call.kind != "numpy":
                outputs = _as_kind(outputs, call)
        else:
            outputs = self._run(call)
        if single and self._sole_output is not None:
            return outputs[self._sole_output]
        return outputs

    def check(self, x: Any) -> CheckedFeed:
        """Check a feed (one array or a dict by input name) against the spec; raises ``FeedError``.

        Returns the checked feed (its batch size in ``.rows``); the batcher checks requests with it.
        """
        return self._check(x, not isinstance(x, Mapping))

    def _check(self, x: Any, single: bool) -> CheckedFeed:
        if single:
            if len(self.input_names) != 1:
                raise FeedError(f"the model takes inputs {self.input_names}: pass a dict {{name: array}}")
            x = {self.input_names[0]: x}
        kind = ""
        rows = -1
        dims: dict[str, int] = {}
        arrays: dict[str, Any] = {}
        for check in self._checks:
            value = x.get(check.name)
            if value is None:
                raise self._mismatch(x)
            if type(value) is np.ndarray:
                if value.dtype != check.np_dtype:
                    _array_of(value, check)  # raises with the message
                this, array = "numpy", value
            else:
                this, array = _array_of(value, check)
            if this != kind:
                if kind:
                    raise FeedError(f"input {check.name!r} is a {this} array and another input a {kind} array: pass "
                                    "all inputs as numpy arrays, or all as torch tensors on one device")
                kind = this
            shape = array.shape
            if len(shape) != len(check.dims):
                raise FeedError(f"input {check.name!r} has shape {tuple(shape)}, the model takes "
                                f"{_dims_text(check.dims)} (rank {len(check.dims)})")
            for axis, size in check.fixed:
                if shape[axis] != size:
                    raise FeedError(f"input {check.name!r} has shape {tuple(shape)}, the model takes "
                                    f"{_dims_text(check.dims)}: dimension {axis} must be {size}")
            if check.batched:
                if rows < 0:
                    rows = shape[0]
                elif shape[0] != rows:
                    raise FeedError(f"input {check.name!r} has batch {shape[0]}, another input batch {rows}: every "
                                    "input needs the same batch size")
            for axis, dim in check.dynamic:
                size = shape[axis]
                have = dims.get(dim)
                if have is None:
                    rng: DimRange = self.spec.dims[dim]
                    if not rng.min <= size <= rng.max:
                        raise FeedError(f"input {check.name!r}: {dim} = {size} is outside the range "
                                        f"{rng.min}..{rng.max} the model was built for")
                    dims[dim] = size
                elif size != have:
                    raise FeedError(f"input {check.name!r} has {dim} = {size}, another input {dim} = {have}")
            arrays[check.name] = array
        if len(x) != len(self.input_names):
            raise self._mismatch(x)
        if rows == 0:
            raise FeedError("the batch is empty (0 rows): pass at least one row")
        call = CheckedFeed(kind, arrays, rows, dims, tuple(dims[d] for d in self._dim_names) if dims else ())
        if kind == "cuda":
            self._place(call)
        return call

    def _mismatch(self, x: Mapping[str, Any]) -> FeedError:
        names = self.input_names
        missing = [n for n in names if x.get(n) is None]
        unknown = [n for n in x if n not in names]
        return FeedError(f"the feed does not match the model's inputs {names}: missing {missing}, unknown {unknown}")

    def _place(self, call: CheckedFeed) -> None:
        """A CUDA feed stays on the device for a GPU backend (same device) and is copied to the host otherwise."""
        arrays = call.arrays
        call.device = next(iter(arrays.values())).device
        if self._backend.device.startswith("cuda"):
            if any(a.device != call.device for a in arrays.values()) or str(call.device) != self._backend.device:
                raise FeedError(f"inputs are on {', '.join(sorted({str(a.device) for a in arrays.values()}))}; "
                                f"these engines run on {self._backend.device}: move them there")
            call.on_device = True
        else:
            call.arrays = {n: a.cpu().numpy() for n, a in arrays.items()}

    def _acquire(self) -> _Context:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._closed:
                raise RuntimeError("these engines are closed")
            grow = len(self._contexts) < self._max_contexts
            if grow:
                context = self._backend.new_context()
                self._contexts.append(context)
                return context
        return self._idle.get()

    def _release(self, context: _Context) -> None:
        self._idle.put(context)

    def _run(self, call: CheckedFeed) -> dict[str, Any]:
        context = self._acquire()
        try:
            largest = self.buckets[-1]
            if call.rows <= largest:
                return self._run_chunk(context, call, 0, call.rows)
            parts = [self._run_chunk(context, call, start, min(start + largest, call.rows))
                     for start in range(0, call.rows, largest)]
        finally:
            self._release(context)
        return {name: _concatenate([p[name] for p in parts]) for name in self.output_names}

    def _run_chunk(self, context: _Context, call: CheckedFeed, start: int, stop: int) -> dict[str, Any]:
        host = not (call.on_device and context.on_gpu)
        context.run(self._route[stop - start], call, start, stop, host)
        if not host:
            return context.copy_outputs_on_device()
        context.wait()
        return _as_kind(context.copy_outputs(), call)

    # -- pipelining --

    def map(self, batches: Iterable[Any], postprocess: Callable[[Any], Any] | None = None, *,
            depth: int = 2) -> Iterator[Any]:
        """Run every batch and yield ``postprocess(outputs)`` (or the outputs) in order.

        Each batch is what ``engines(...)`` takes, and ``postprocess`` gets what it returns. Batch
        n+1 is copied in and computed while batch n is post-processed: on a GPU backend with
        ``depth`` buffer sets (contexts, each on its own CUDA stream, with pinned host buffers),
        on a CPU backend with the compute in a second thread. A buffer set is given back as soon
        as its outputs are copied out, before ``postprocess`` runs, so post-processing never holds
        up the copies and compute of the next batches. Everything is synchronized before the last
        result is yielded; leaving the loop early stops the work.
        """
        if depth < 1:
            raise InputError(f"depth={depth}: map needs at least one buffer set")
        ready: queue.Queue[tuple[Any, ...]] = queue.Queue()
        in_flight = threading.Semaphore(depth)
        stop = threading.Event()
        gate = threading.Lock()  # after the consumer stops (under it), no context enters ``ready``
        largest = self.buckets[-1]

        def submit() -> None:
            try:
                for batch in batches:
                    while not in_flight.acquire(timeout=0.05):
                        if stop.is_set():
                            return
                    if stop.is_set():
                        return
                    single = not isinstance(batch, Mapping)
                    call = self.check(batch)
                    if call.rows > largest:  # chunked: runs whole, outputs copied out
                        ready.put(("done", self._run(call), call, single))
                        continue
                    context = self._acquire()
                    try:
                        context.run(self._route[call.rows], call, 0, call.rows,
                                    not (call.on_device and context.on_gpu))
                    except BaseException:
                        self._release(context)
                        raise
                    with gate:
                        if stop.is_set():
                            context.wait()
                            self._release(context)
                            return
                        ready.put(("context", context, call, single))
                ready.put(("end",))
            except BaseException as err:  # handed to the consumer, raised there in order
                ready.put(("error", err))

        worker = threading.Thread(target=submit, name="trtc-map-submit", daemon=True)
        worker.start()
        try:
            while True:
                item = ready.get()
                if item[0] == "end":
                    break
                if item[0] == "error":
                    raise item[1]
                if item[0] == "done":
                    _, outputs, call, single = item
                    in_flight.release()
                    value = outputs[self.output_names[0]] if single and len(self.output_names) == 1 else outputs
                    yield postprocess(value) if postprocess is not None else value
                    continue
                _, context, call, single = item
                try:
                    if call.on_device and context.on_gpu:
                        outputs = context.copy_outputs_on_device()
                    else:
                        context.wait()
                        outputs = _as_kind(context.copy_outputs(), call)
                finally:  # free for batch n+2 while batch n is post-processed
                    self._release(context)
                    in_flight.release()
                value = outputs[self.output_names[0]] if single and len(self.output_names) == 1 else outputs
                yield postprocess(value) if postprocess is not None else value
        finally:
            with gate:
                stop.set()
            while True:  # contexts the submitter queued before the consumer stopped
                try:
                    item = ready.get_nowait()
                except queue.Empty:
                    break
                if item[0] == "context":
                    item[1].wait()
                    self._release(item[1])
            if worker.is_alive():
                log.debug("map: the batch iterator is still producing; its thread ends with it")


def _dims_text(dims: tuple[int | str, ...]) -> str:
    return "x".join(str(d) for d in dims)


def _concatenate(parts: list[Any]) -> Any:
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    import torch

    return torch.cat(parts)


def _as_kind(outputs: dict[str, np.ndarray], call: CheckedFeed) -> dict[str, Any]:
    """Host numpy outputs as the feed's kind: numpy, CPU tensors (shared memory) or CUDA tensors."""
    if call.kind == "numpy":
        return outputs
    import torch

    if call.kind == "torch":
        return {name: torch.from_numpy(a) for name, a in outputs.items()}
    return {name: torch.from_numpy(a).to(call.device) for name, a in outputs.items()}


# --- CPU contexts: ONNX Runtime and eager PyTorch ------------------------------------------------------------------

class _HostContext:
    """Input buffers in host memory for every bucket at its largest shape; ``execute`` is the backend's."""

    on_gpu = False

    def __init__(self, spec: ModelSpec, buckets: Sequence[int]) -> None:
        self._spec = spec
        self._flat = {(b, i.name): np.zeros(math.prod(i.shape(_max_values(spec, b))), _NUMPY_DTYPES[i.dtype])
                      for b in buckets for i in spec.inputs}
        self._views: dict[tuple[int, tuple[int, ...]], list[tuple[str, np.ndarray, bool]]] = {}
        self._last: dict[str, np.ndarray] = {}
        self._rows = 0

    def input_views(self, bucket: int, call: CheckedFeed) -> list[tuple[str, np.ndarray, bool]]:
        """Per input: (name, view of its buffer at the call's shape, whether it is batched)."""
        views = self._views.get((bucket, call.key))
        if views is None:
            values = _call_values(call, bucket)
            views = []
            for i in self._spec.inputs:
                shape = i.shape(values)
                views.append((i.name, self._flat[bucket, i.name][:math.prod(shape)].reshape(shape),
                              bool(i.dims) and i.dims[0] == BATCH_DIM))
            _remember(self._views, (bucket, call.key), views)
        return views

    def run(self, bucket: int, call: CheckedFeed, start: int, stop: int, host: bool) -> None:
        rows = stop - start
        whole = rows == call.rows
        arrays = call.arrays
        for name, view, batched in self.input_views(bucket, call):
            if batched:
                view[:rows] = arrays[name] if whole else arrays[name][start:stop]
            else:
                view[...] = arrays[name]
        self._last = self.execute(bucket, call)
        self._rows = rows

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        raise NotImplementedError

    def wait(self) -> None:
        pass

    def outputs(self) -> dict[str, Any]:
        rows = self._rows
        return {name: out[:rows] for name, out in self._last.items()}

    def copy_outputs(self) -> dict[str, np.ndarray]:
        rows = self._rows
        return {name: out[:rows].copy() for name, out in self._last.items()}

    def copy_outputs_on_device(self) -> dict[str, Any]:
        raise AssertionError("a CPU context has no device outputs")

    def close(self) -> None:
        self._flat.clear()
        self._views.clear()


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    """Insert into a small cache that drops its oldest entry beyond ``_BINDING_CACHE``."""
    cache[key] = value
    if len(cache) > _BINDING_CACHE:
        cache.pop(next(iter(cache)))


@dataclass
class _OrtBinding:
    binding: Any  # onnxruntime.IOBinding
    inputs: list[tuple[str, np.ndarray, bool]]  # as ``input_views`` gives them
    outputs: dict[str, np.ndarray] | None  # preallocated outputs; None: ONNX Runtime allocates them
    keep: list[Any] = field(default_factory=list)  # OrtValues bound by pointer


class _OrtCpuContext(_HostContext):
    """ONNX Runtime on the CPU: one IOBinding per bucket (and dynamic sizes) over preallocated arrays."""

    def __init__(self, backend: _OrtBackend) -> None:
        super().__init__(backend.spec, backend.buckets)
        self._backend = backend
        self._out_flat: dict[tuple[int, str], np.ndarray] = {}
        if backend.outputs_resolvable:
            for b in backend.buckets:
                values = _max_values(backend.spec, b)
                for name in backend.output_names:
                    shape = backend.output_shape(name, values)
                    self._out_flat[b, name] = np.zeros(math.prod(shape), backend.output_dtypes[name])
        self._bindings: dict[tuple[int, tuple[int, ...]], _OrtBinding] = {}
        self._run_bound = backend.session.run_with_iobinding

    def run(self, bucket: int, call: CheckedFeed, start: int, stop: int, host: bool) -> None:
        """``_HostContext.run`` with the binding's views: one lookup per call (this is the CPU hot path)."""
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

    def _allocated(self, entry: _OrtBinding) -> dict[str, np.ndarray]:
        return dict(zip(self._backend.output_names, entry.binding.copy_outputs_to_cpu()))

    def _binding(self, bucket: int, call: CheckedFeed) -> _OrtBinding:
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
            values = _call_values(call, bucket)
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
        entry = _OrtBinding(binding, inputs, outputs, keep)
        _remember(self._bindings, (bucket, call.key), entry)
        return entry

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        entry = self._binding(bucket, call)
        self._run_bound(entry.binding)
        return entry.outputs if entry.outputs is not None else self._allocated(entry)

    def close(self) -> None:
        super().close()
        self._bindings.clear()
        self._out_flat.clear()


class _TorchCpuContext(_HostContext):
    """Eager PyTorch on the CPU, reading the preallocated input arrays in place."""

    def __init__(self, backend: _TorchBackend) -> None:
        super().__init__(backend.spec, backend.buckets)
        self._backend = backend

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        import torch

        args = [torch.from_numpy(view) for _, view, _ in self.input_views(bucket, call)]
        return {name: t.numpy() for name, t in zip(self._backend.output_names, self._backend.forward(args))}


# --- GPU contexts: pinned host buffers, device buffers, one CUDA stream ------------------------------------------

class _ComputeOrder:
    """Orders the model runs of all contexts of one backend on the GPU, one after the other.

    Copies still overlap them (each context copies on its own stream), but two runs never share
    the GPU: measured on an H200, two CUDA graphs of a CNN replayed concurrently took 2.3 ms each
    instead of 1.3 ms, and then finished together, leaving nothing queued behind them.
    """

    def __init__(self) -> None:
        import torch

        self.lock = threading.Lock()
        self.done = torch.cuda.Event()  # recorded after the last run queued


class _GpuContext:
    """Device input buffers per bucket (largest shape), pinned host staging, and the context's CUDA stream.

    Subclasses implement ``execute``: run on the device inputs, queued on ``self.stream``, and
    return the device outputs at the bucket's batch.
    """

    on_gpu = True

    def __init__(self, spec: ModelSpec, buckets: Sequence[int], device: str, dtypes: dict[str, Any],
                 order: _ComputeOrder) -> None:
        import torch

        self._torch = torch
        self._order = order
        self._spec = spec
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self._done = torch.cuda.Event()
        self._batched = {i.name: bool(i.dims) and i.dims[0] == BATCH_DIM for i in spec.inputs}
        self._device_flat: dict[tuple[int, str], torch.Tensor] = {}
        self._host_flat: dict[tuple[int, str], torch.Tensor] = {}
        self._host_np: dict[tuple[int, str], np.ndarray] = {}
        for b in buckets:
            values = _max_values(spec, b)
            for i in spec.inputs:
                numel = math.prod(i.shape(values))
                # zeros: warm-up and capture read them, and zero is a valid token id, mask and pixel
                self._device_flat[b, i.name] = torch.zeros(numel, dtype=dtypes[i.name], device=self.device)
                self._host_flat[b, i.name] = torch.zeros(numel, dtype=dtypes[i.name], pin_memory=True)
                self._host_np[b, i.name] = self._host_flat[b, i.name].numpy()
        self._views: dict[tuple[int, tuple[int, ...]], dict[str, tuple[Any, Any, np.ndarray]]] = {}
        self._host_out: dict[str, torch.Tensor] = {}
        self._last: dict[str, Any] = {}
        self._last_host = True

    def device_inputs(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        return {name: views[0] for name, views in self._input_views(bucket, call).items()}

    def _input_views(self, bucket: int, call: CheckedFeed) -> dict[str, tuple[Any, Any, np.ndarray]]:
        """Per input: (device view, pinned host view, numpy view of it) at the call's shape."""
        views = self._views.get((bucket, call.key))
        if views is None:
            values = _call_values(call, bucket)
            views = {}
            for i in self._spec.inputs:
                shape = i.shape(values)
                numel = math.prod(shape)
                views[i.name] = (self._device_flat[bucket, i.name][:numel].view(shape),
                                 self._host_flat[bucket, i.name][:numel].view(shape),
                                 self._host_np[bucket, i.name][:numel].reshape(shape))
            _remember(self._views, (bucket, call.key), views)
        return views

    def run(self, bucket: int, call: CheckedFeed, start: int, stop: int, host: bool) -> None:
        torch = self._torch
        rows = stop - start
        views = self._input_views(bucket, call)
        if call.on_device:  # the feed was written on the caller's stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for name, (device_view, host_view, host_np) in views.items():
                batched = self._batched[name]
                source = call.arrays[name][start:stop] if batched else call.arrays[name]
                target = device_view[:rows] if batched else device_view
                if call.on_device:
                    target.copy_(source, non_blocking=True)
                    source.record_stream(self.stream)  # the caller's memory is read here, later
                else:
                    self.stage(host_np[:rows] if batched else host_np, host_view[:rows] if batched else host_view,
                               source)
                    target.copy_(host_view[:rows] if batched else host_view, non_blocking=True)
            with self._order.lock:  # after the run queued last by any context; our copies above overlap it
                self.stream.wait_event(self._order.done)
                outputs = {name: out[:rows] for name, out in self.execute(bucket, call).items()}
                self._order.done.record(self.stream)
            if host:
                staged = {}
                for name, out in outputs.items():
                    pinned = self._pinned_output(name, out.numel(), out.dtype)[:out.numel()].view(out.shape)
                    pinned.copy_(out, non_blocking=True)
                    staged[name] = pinned.numpy()
                self._last = staged
            else:
                self._last = outputs
            self._done.record(self.stream)
        self._last_host = host

    def stage(self, host_np: np.ndarray, host_view: Any, source: np.ndarray) -> None:
        """Copy a host array into pinned memory: numpy for small arrays, torch's parallel copy (GIL released)
        for large ones."""
        if source.nbytes < _PARALLEL_COPY_BYTES or not source.flags.writeable or min(source.strides, default=0) < 0:
            np.copyto(host_np, source)
        else:
            host_view.copy_(self._torch.from_numpy(source))

    def _pinned_output(self, name: str, numel: int, dtype: Any) -> Any:
        buffer = self._host_out.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype:
            buffer = self._torch.empty(numel, dtype=dtype, pin_memory=True)
            self._host_out[name] = buffer
        return buffer

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        raise NotImplementedError

    def wait(self) -> None:
        self._done.synchronize()

    def outputs(self) -> dict[str, Any]:
        return self._last

    def copy_outputs(self) -> dict[str, np.ndarray]:
        return {name: view.copy() for name, view in self._last.items()}

    def copy_outputs_on_device(self) -> dict[str, Any]:
        """The last run's device outputs copied into fresh tensors the caller's stream owns; waits for them."""
        torch = self._torch
        copies = {name: torch.empty_like(view) for name, view in self._last.items()}  # allocated on the caller's stream
        with torch.cuda.stream(self.stream):
            for name, view in self._last.items():
                copies[name].copy_(view, non_blocking=True)
            self._done.record(self.stream)
        self._done.synchronize()
        return copies

    def close(self) -> None:
        self.stream.synchronize()
        self._views.clear()
        self._device_flat.clear()
        self._host_flat.clear()
        self._host_np.clear()
        self._host_out.clear()


def _capture(stream: Any, launch: Callable[[], Any], what: str) -> tuple[Any, Any] | None:
    """Warm up ``launch`` on ``stream``, then capture it in a CUDA graph: (graph, what launch returned).

    None when capture fails (an op that cannot be captured): the caller runs without a graph.
    Capture is thread-local, so other threads may use the GPU meanwhile.
    """
    import torch

    with torch.cuda.stream(stream):
        for _ in range(3):  # first runs allocate workspaces and pick kernels; a graph must not capture that
            launch()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            result = launch()
    except RuntimeError as err:
        log.info("%s: CUDA graph capture failed (%s); running without a graph", what, str(err).splitlines()[0])
        return None
    return graph, result


class _TorchCudaContext(_GpuContext):
    """Eager PyTorch on the context's stream; one CUDA graph per bucket for fixed-shape models."""

    def __init__(self, backend: _TorchBackend) -> None:
        import torch

        dtypes = {i.name: getattr(torch, i.dtype) for i in backend.spec.inputs}
        assert backend.order is not None
        super().__init__(backend.spec, backend.buckets, backend.device, dtypes, backend.order)
        self._backend = backend
        self._graphs: dict[int, tuple[Any, dict[str, Any]]] = {}
        if backend.cuda_graphs and not backend.spec.dims:
            for b in backend.buckets:
                args = self._args(b, CheckedFeed("numpy", {}, b, {}, ()))
                captured = _capture(self.stream, functools.partial(backend.forward, args), f"bucket {b}")
                if captured is not None:
                    graph, outputs = captured
                    self._graphs[b] = (graph, dict(zip(backend.output_names, outputs)))

    def _args(self, bucket: int, call: CheckedFeed) -> list[Any]:
        inputs = self.device_inputs(bucket, call)
        return [inputs[name] for name in self._spec.input_names]

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        captured = self._graphs.get(bucket)
        if captured is not None:
            captured[0].replay()  # on the current stream: run() has made it the context's
            return captured[1]
        return dict(zip(self._backend.output_names, self._backend.forward(self._args(bucket, call))))


class _OrtCudaContext(_GpuContext):
    """ONNX Runtime's CUDA provider on device buffers bound by pointer (it runs on its own stream)."""

    def __init__(self, backend: _OrtBackend) -> None:
        import torch

        dtypes = {i.name: getattr(torch, i.dtype) for i in backend.spec.inputs}
        assert backend.order is not None
        super().__init__(backend.spec, backend.buckets, backend.device, dtypes, backend.order)
        self._backend = backend
        self._out_flat: dict[tuple[int, str], torch.Tensor] = {}
        if backend.outputs_resolvable:
            for b in backend.buckets:
                values = _max_values(backend.spec, b)
                for name in backend.output_names:
                    numel = math.prod(backend.output_shape(name, values))
                    dtype = torch.from_numpy(np.empty(0, backend.output_dtypes[name])).dtype
                    self._out_flat[b, name] = torch.empty(numel, dtype=dtype, device=self.device)
        self._bindings: dict[tuple[int, tuple[int, ...]], tuple[Any, dict[str, Any] | None]] = {}

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        import torch

        backend = self._backend
        entry = self._bindings.get((bucket, call.key))
        if entry is None:
            binding = backend.session.io_binding()
            index = self.device.index or 0
            for i in backend.spec.inputs:
                view = self.device_inputs(bucket, call)[i.name]
                binding.bind_input(i.name, "cuda", index, _NUMPY_DTYPES[i.dtype], tuple(view.shape), view.data_ptr())
            outputs: dict[str, Any] | None = None
            if backend.outputs_resolvable:
                values = _call_values(call, bucket)
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
            _remember(self._bindings, (bucket, call.key), entry)
        binding, outputs = entry
        self.stream.synchronize()  # the inputs were copied on our stream; ONNX Runtime reads them on its own
        backend.session.run_with_iobinding(binding)  # returns when its stream is done
        if outputs is not None:
            return outputs
        return {name: torch.from_numpy(a).to(self.device)
                for name, a in zip(backend.output_names, binding.copy_outputs_to_cpu())}

    def close(self) -> None:
        super().close()
        self._bindings.clear()
        self._out_flat.clear()


# --- TensorRT -----------------------------------------------------------------------------------------------------

_TRT_LOGGER: Any = None


def _trt_logger() -> trt.ILogger:
    global _TRT_LOGGER
    import tensorrt as trt

    if _TRT_LOGGER is None:  # TensorRT wants one logger per process
        _TRT_LOGGER = trt.Logger(trt.Logger.WARNING)
    return _TRT_LOGGER


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

    def __init__(self, directory: Path, manifest: dict[str, Any], spec: ModelSpec, device: str,
                 cuda_graphs: bool) -> None:
        import tensorrt as trt
        import torch

        self.spec = spec
        self.device = device
        self.cuda_graphs = cuda_graphs
        self.runtime = trt.Runtime(_trt_logger())
        self.runtime.engine_host_code_allowed = True  # version-compatible engines carry the lean runtime
        engines: dict[str, trt.ICudaEngine] = {}
        self.profiles: dict[int, tuple[trt.ICudaEngine, int]] = {}
        with torch.cuda.device(torch.device(device)):
            for entry in manifest["engines"]:
                file = str(entry["file"])
                if file not in engines:
                    engine = self.runtime.deserialize_cuda_engine((directory / file).read_bytes())
                    if engine is None:
                        raise EnginesNotRunnable(f"{directory / file}: TensorRT cannot load this engine (see its log "
                                                 f"above); run `trtc rebuild {directory}`")
                    engines[file] = engine
                self.profiles[int(entry["bucket"])] = (engines[file], int(entry.get("profile", 0)))
        self.buckets = tuple(sorted(self.profiles))
        first = next(iter(engines.values()))
        names = [first.get_tensor_name(i) for i in range(first.num_io_tensors)]
        inputs = [n for n in names if first.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if first.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if sorted(inputs) != sorted(spec.input_names):
            raise EnginesNotRunnable(f"the engines take inputs {inputs}, the manifest declares {spec.input_names}; "
                                     f"run `trtc rebuild {directory}`")
        declared = list(manifest.get("output_names") or [])
        self.output_names = declared if sorted(declared) == sorted(outputs) else outputs
        self.dtypes = {n: _torch_dtype_of(first.get_tensor_dtype(n)) for n in names}
        with torch.cuda.device(torch.device(device)):
            self.order = _ComputeOrder()

    def new_context(self) -> _TensorRTContext:
        return _TensorRTContext(self)

    def close(self) -> None:
        self.profiles.clear()


@dataclass
class _TrtBucket:
    context: Any  # trt.IExecutionContext
    outputs_flat: dict[str, Any]
    shape_key: tuple[int, ...] | None = None
    outputs: dict[str, Any] = field(default_factory=dict)  # views of outputs_flat at the current shapes
    graph: Any = None


class _TensorRTContext(_GpuContext):
    """One IExecutionContext per bucket with its optimization profile; addresses bound once, at creation."""

    def __init__(self, backend: _TensorRTBackend) -> None:
        import torch

        super().__init__(backend.spec, backend.buckets, backend.device, backend.dtypes, backend.order)
        self._backend = backend
        self._buckets: dict[int, _TrtBucket] = {}
        handle = self.stream.cuda_stream
        with torch.cuda.device(self.device):
            for b in backend.buckets:
                engine, profile = backend.profiles[b]
                context = engine.create_execution_context()
                if context is None:
                    raise EnginesNotRunnable(f"TensorRT could not create an execution context for bucket {b} (out of "
                                             "GPU memory?); use fewer contexts or buckets")
                if engine.num_optimization_profiles > 1:
                    context.set_optimization_profile_async(profile, handle)
                values = _max_values(backend.spec, b)
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
                        launch = functools.partial(context.execute_async_v3, handle)
                        captured = _capture(self.stream, launch, f"bucket {b}")
                        state.graph = captured[0] if captured is not None else None

    def _set_shapes(self, bucket: int, state: _TrtBucket, call: CheckedFeed) -> None:
        values = _call_values(call, bucket)
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
        self._buckets.clear()


# --- ONNX Runtime and PyTorch backends ---------------------------------------------------------------------------

class _OrtBackend:
    name = "onnxruntime"

    def __init__(self, path: Path, spec: ModelSpec, buckets: Sequence[int], device: str | None, threads: int) -> None:
        from compiler.onnx_io import ort_session, usable_providers

        self.spec = spec
        self.buckets = tuple(buckets)
        self.path = path
        if device is None:
            providers = usable_providers(["CUDAExecutionProvider", "CPUExecutionProvider"])
        elif device == "cpu":
            providers = ["CPUExecutionProvider"]
        else:
            providers = usable_providers(["CUDAExecutionProvider", "CPUExecutionProvider"])
            if providers[0] != "CUDAExecutionProvider":
                raise InputError(f"device={device!r}: ONNX Runtime has no usable CUDA provider here (install "
                                 "onnxruntime-gpu on a machine with a GPU), or pass device='cpu'")
            if device not in ("cuda", "cuda:0"):
                raise InputError(f"device={device!r}: ONNX Runtime serving runs on cuda:0; select the GPU with "
                                 "CUDA_VISIBLE_DEVICES")
        self.session = ort_session(path, providers, threads=threads)
        self.provider = self.session.get_providers()[0]
        self.device = "cuda:0" if self.provider == "CUDAExecutionProvider" else "cpu"
        self.order = _ComputeOrder() if self.device != "cpu" else None
        names = [i.name for i in self.session.get_inputs()]
        if sorted(names) != sorted(spec.input_names):
            raise InputError(f"{path} takes inputs {names}, the manifest declares {spec.input_names}; rebuild the "
                             "directory")
        import onnx
        from onnx.helper import tensor_dtype_to_np_dtype

        graph = onnx.load(str(path), load_external_data=False).graph
        self.output_names = [o.name for o in graph.output]
        self.output_dtypes = {o.name: tensor_dtype_to_np_dtype(o.type.tensor_type.elem_type) for o in graph.output}
        self._output_dims: dict[str, list[int | str | None]] = {
            o.name: [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                     for d in o.type.tensor_type.shape.dim] for o in graph.output}
        known = {BATCH_DIM, *spec.dims}
        self.outputs_resolvable = all(
            isinstance(d, int) or d in known for dims in self._output_dims.values() for d in dims) and all(
            dims and dims[0] == BATCH_DIM for dims in self._output_dims.values())

    def output_shape(self, name: str, values: dict[str, int]) -> tuple[int, ...]:
        return tuple(d if isinstance(d, int) else values[str(d)] for d in self._output_dims[name])

    def new_context(self) -> _Context:
        if self.device == "cpu":
            return _OrtCpuContext(self)
        return _OrtCudaContext(self)

    def close(self) -> None:
        del self.session


class _TorchBackend:
    name = "torch"

    def __init__(self, module: Any, spec: ModelSpec, buckets: Sequence[int], output_names: Sequence[str] | None,
                 device: str | None, cuda_graphs: bool) -> None:
        import torch

        self.spec = spec
        self.buckets = tuple(sorted(buckets))
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        target = torch.device(device)
        if target.type == "cuda" and target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
        self.device = str(target)
        self.cuda_graphs = cuda_graphs
        self.order = _ComputeOrder() if target.type == "cuda" else None
        self.module = module.eval().to(target)
        probe = spec.example_feed(self.buckets[0])
        count = len(self.forward([torch.from_numpy(probe[n]).to(target) for n in spec.input_names]))
        names = list(output_names or [])
        self.output_names = names if len(names) == count else [f"output_{i}" for i in range(count)]

    def forward(self, args: list[Any]) -> list[Any]:
        import torch
        from torch.utils._pytree import tree_flatten

        with torch.inference_mode():
            flat, _ = tree_flatten(self.module(*args))
        return flat

    def new_context(self) -> _Context:
        if self.device == "cpu":
            return _TorchCpuContext(self)
        return _TorchCudaContext(self)

    def close(self) -> None:
        pass


# --- loading ------------------------------------------------------------------------------------------------------

_FALLBACK_LOGGED: set[str] = set()
_FALLBACK_LOCK = threading.Lock()


def _log_fallback_once(directory: Path, backend: _OrtBackend) -> None:
    key = str(directory.resolve())
    with _FALLBACK_LOCK:
        if key in _FALLBACK_LOGGED:
            return
        _FALLBACK_LOGGED.add(key)
    log.warning("TensorRT is not installed here: serving %s with ONNX Runtime (%s) on %s", directory,
                backend.provider, backend.path.name)


def tensorrt_available() -> bool:
    """Whether a real TensorRT imports here (what ``backend="auto"`` decides on)."""
    from compiler.engines import tensorrt_version

    return tensorrt_version() is not None


def _tensorrt_backend(directory: Path, manifest: dict[str, Any], spec: ModelSpec, device: str | None,
                      cuda_graphs: bool) -> _TensorRTBackend:
    """The TensorRT backend after the checks ``trtc check`` makes: installed, engines built, none stale."""
    from compiler.engines import require_tensorrt

    require_tensorrt(directory)  # TensorRTNotInstalled, naming `trtc rebuild DIR`
    if not manifest.get("engines"):
        note = manifest.get("engines_note") or "none were built"
        raise EnginesNotRunnable(f"{directory} has no TensorRT engines ({note}); run `trtc rebuild {directory}` "
                                 "on a machine with TensorRT and a GPU, or load it with backend='onnxruntime'")
    from compiler.check import stale_engines

    stale = stale_engines(directory)
    if stale:
        reasons = "; ".join(str(s) for s in stale)
        raise EnginesNotRunnable(f"stale engines in {directory}: {reasons}; run `trtc rebuild {directory}`")
    import torch

    if not torch.cuda.is_available():
        raise EnginesNotRunnable("TensorRT engines run on a CUDA GPU and torch sees none here; load with "
                                 "backend='onnxruntime' on this machine")
    target = torch.device(device or "cuda")
    if target.type != "cuda":
        raise InputError(f"device={device!r}: TensorRT engines run on a CUDA device")
    if target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    return _TensorRTBackend(directory, manifest, spec, str(target), cuda_graphs)


def onnx_for_precision(directory: Path, manifest: dict[str, Any]) -> Path:
    precision = manifest.get("precision") or "fp32"
    entry = (manifest.get("onnx") or {}).get(precision)
    if entry is None:
        raise InputError(f"{directory}: the manifest's precision is {precision} but it lists no onnx.{precision} "
                         "file; run `trtc build` into the directory again")
    path = directory / entry["file"]
    if not path.is_file():
        raise InputError(f"{path}: missing; the directory is incomplete, run `trtc build` into it again")
    return path


def _source_module(manifest: dict[str, Any], trust_pickle: bool) -> Any:
    from compiler.loading import load_model

    source = manifest.get("source") or {}
    text = str(source.get("path") or "")
    if source.get("format") == "factory":
        factory, _, weights = text.partition(" + ")
        loaded = load_model(factory=factory, weights=weights or None)
    elif source.get("format") == "onnx":
        raise InputError("the directory was exported from an ONNX file: there is no PyTorch model to run; use "
                         "backend='onnxruntime'")
    else:
        loaded = load_model(text, trust_pickle=trust_pickle)
    return loaded.module


def load(directory: str | Path, backend: str = "auto", *, device: str | None = None, contexts: int = 2,
         cuda_graphs: bool = True, threads: int = 0, trust_pickle: bool = False) -> Engines:
    """The engines of a build directory, ready to serve: ``engines(x)``, ``engines.map(...)``.

    ``backend``: ``auto`` (TensorRT when installed, else ONNX Runtime, logged once), ``tensorrt``,
    ``onnxruntime`` or ``torch`` (the source model, eager). TensorRT engines are checked as
    ``trtc check`` does; a stale or missing engine raises ``EnginesNotRunnable`` naming
    ``trtc rebuild``, a missing TensorRT ``TensorRTNotInstalled``. ``device``: ``cpu``, ``cuda``
    or ``cuda:N``; None picks the GPU when the backend can use one. ``contexts``: how many callers
    run at once (each context holds buffers for every bucket). ``cuda_graphs``: capture one graph
    per bucket on a GPU (fixed-shape models only). ``threads``: ONNX Runtime's intra-op threads
    (0: its default). ``trust_pickle``: let the torch backend load a pickled model file.
    """
    from compiler.engines import spec_from_manifest
    from compiler.manifest import read_manifest

    directory = Path(directory)
    if backend not in BACKENDS:
        raise InputError(f"backend={backend!r}: use one of {', '.join(BACKENDS)}")
    manifest = read_manifest(directory)
    spec = spec_from_manifest(manifest)
    buckets = tuple(int(b) for b in manifest.get("buckets") or ())
    if not buckets:
        raise InputError(f"{directory}: the manifest lists no buckets; run `trtc export` into it again")
    chosen = backend
    if backend == "auto":
        chosen = "tensorrt" if tensorrt_available() else "onnxruntime"
    impl: _Backend
    if chosen == "tensorrt":
        impl = _tensorrt_backend(directory, manifest, spec, device, cuda_graphs)
    elif chosen == "onnxruntime":
        ort_backend = _OrtBackend(onnx_for_precision(directory, manifest), spec, buckets, device, threads)
        if backend == "auto":
            _log_fallback_once(directory, ort_backend)
        impl = ort_backend
    else:
        if manifest.get("precision", "fp32") != "fp32":
            log.info("backend torch runs the FP32 source model, not the %s graph", manifest["precision"])
        impl = _TorchBackend(_source_module(manifest, trust_pickle), spec, buckets, manifest.get("output_names"),
                             device, cuda_graphs)
    engines = Engines(impl, contexts)
    log.info("serving %s with %s on %s: buckets %s, up to %d concurrent contexts", directory, engines.backend,
             engines.device, ",".join(map(str, engines.buckets)), contexts)
    return engines


def engines_from_module(module: Any, inputs: Sequence[str | InputSpec] | ModelSpec,
                        buckets: Sequence[int] = (1, 4, 8, 16), *, dims: Mapping[str, str | DimRange] | None = None,
                        output_names: Sequence[str] | None = None, device: str | None = None, contexts: int = 2,
                        cuda_graphs: bool = True) -> Engines:
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
    return Engines(_TorchBackend(module, spec, buckets, output_names, device, cuda_graphs), contexts)
