"""What the serving runtime's backends build on: the checked feed, the backend and context contract,
and the two kinds of context that hold a bucket's buffers.

* ``_HostContext``: input buffers in host memory (ONNX Runtime and eager PyTorch on the CPU).
* ``_GpuContext``: device input buffers, pinned host staging and one CUDA stream per context
  (TensorRT, ONNX Runtime's CUDA provider and eager PyTorch on a GPU), with ``_ComputeOrder``
  keeping the model runs of one backend's contexts in sequence and ``_capture`` for CUDA graphs.
  Each has ``BUFFER_SETS`` buffer sets (``lane``): the host copies the next batch into one set's
  pinned staging while the last batch, from the other set, runs on the GPU; large inputs go to the
  device on a copy stream of the set's own.

The front end (``Engines``, ``load``) is ``compiler.serve.engines``; the backends are
``compiler.backends.trt``, ``compiler.backends.onnxrt`` and ``compiler.backends.pytorch``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import logging
import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from compiler.core.errors import first_line
from compiler.core.specs import BATCH_DIM, ModelSpec

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

_NUMPY_DTYPES: dict[str, Any] = {"float32": np.float32, "float16": np.float16, "int64": np.int64, "int32": np.int32,
                                 "int8": np.int8, "uint8": np.uint8, "bool": np.bool_, "bfloat16": None}
_BINDING_CACHE = 32  # (bucket, dynamic sizes) combinations whose views and bindings a context keeps
_PARALLEL_COPY_BYTES = 1 << 20  # inputs this large are staged with torch's multi-threaded copy
# Buffer sets (pinned staging and host outputs) per GPU context: with two, one context takes a second batch while
# its first runs (on an H200 one context and one set ran a CNN's batcher at 64-75 % of its bound: the 64 requests'
# copy into the set waited for the GPU).
BUFFER_SETS = 2
# Host inputs this large go to the device on their buffer set's own copy stream (``_GpuContext._to_device``), so the
# copy overlaps the model run the context's stream is busy with; smaller ones, whose copy takes microseconds, stay on
# the context's stream without the extra device-to-device copy and two events.
_OVERLAPPED_COPY_BYTES = 1 << 20


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


def as_kind(outputs: dict[str, np.ndarray], call: CheckedFeed) -> dict[str, Any]:
    """Host numpy outputs as the feed's kind: numpy, CPU tensors (shared memory) or CUDA tensors on its device."""
    if call.kind == "numpy":
        return outputs
    import torch

    if call.kind == "torch":
        return {name: torch.from_numpy(a) for name, a in outputs.items()}
    return {name: torch.from_numpy(a).to(call.device) for name, a in outputs.items()}


# --- what backends provide ----------------------------------------------------------------------------------------

class _Context(Protocol):
    """One buffer set of an execution context (``buffer_sets``), with input and output buffers for every bucket;
    one caller at a time.

    ``run`` copies rows ``start:stop`` of the call into the bucket's buffers and starts the work
    (asynchronous on a GPU: copies and compute are queued on the context's stream); ``wait`` blocks
    until it is done, ``ready`` says whether it is. ``run`` is ``upload``, ``compute`` and
    ``download`` in one call: the three are separate so that ``trtc bench`` times the served path
    itself (device time around ``compute``, end to end around all three). ``outputs`` are the last
    run's real rows: views of this buffer set's host arrays when ``run`` was asked for ``host``
    outputs (valid after ``wait``), else new device tensors for the caller's stream. ``execute`` is
    the bare model run on buffers already filled. ``stream``: the CUDA stream the context's work is
    queued on (None on the CPU).
    ``overlaps``: whether the host is free while the model runs (``map`` pipelines only then).
    ``hold`` keeps the context to the caller across ``upload``, ``compute`` and ``download`` (other
    buffer sets of the same context wait to queue their work meanwhile).
    """

    on_gpu: bool
    stream: Any
    overlaps: bool
    launches_on_host: bool

    def run(self, bucket: int, call: CheckedFeed, start: int, stop: int, host: bool) -> None: ...

    def upload(self, bucket: int, call: CheckedFeed, start: int, stop: int) -> None: ...

    def start(self, bucket: int, calls: Sequence[CheckedFeed], out: Mapping[str, np.ndarray] | None = None) -> None: ...

    def compute(self, bucket: int, call: CheckedFeed) -> None: ...

    def download(self, host: bool) -> None: ...

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]: ...

    def wait(self) -> None: ...

    def ready(self) -> bool: ...

    def outputs(self) -> dict[str, Any]: ...

    def copy_outputs(self) -> dict[str, np.ndarray]: ...

    def copy_outputs_on_device(self) -> dict[str, Any]: ...

    def hold(self) -> contextlib.AbstractContextManager[Any]: ...

    def buffer_sets(self) -> list[_Context]: ...

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


# --- host contexts: ONNX Runtime and eager PyTorch on the CPU -----------------------------------------------------

class _HostContext:
    """Input buffers in host memory for every bucket at its largest shape; ``execute`` is the backend's."""

    on_gpu = False
    stream = None
    overlaps = True  # ONNX Runtime and torch release the GIL while they compute
    launches_on_host = False

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

    def upload(self, bucket: int, call: CheckedFeed, start: int, stop: int) -> None:
        rows = stop - start
        for name, view, batched in self.input_views(bucket, call):
            if batched:
                view[:rows] = call.arrays[name][start:stop]
            else:
                view[...] = call.arrays[name]
        self._rows = rows

    def upload_parts(self, bucket: int, calls: Sequence[CheckedFeed]) -> None:
        first = calls[0]
        rows = sum(call.rows for call in calls)
        for name, view, batched in self.input_views(bucket, first):
            if not batched:
                view[...] = first.arrays[name]
                continue
            offset = 0
            for call in calls:
                view[offset:offset + call.rows] = call.arrays[name]
                offset += call.rows
        self._rows = rows

    def compute(self, bucket: int, call: CheckedFeed) -> None:
        self._last = self.execute(bucket, call)

    def download(self, host: bool) -> None:
        pass  # the outputs are host arrays already

    def start(self, bucket: int, calls: Sequence[CheckedFeed], out: Mapping[str, np.ndarray] | None = None) -> None:
        """``upload_parts`` and ``compute``; the outputs are the backend's own host arrays (``out`` is for GPUs)."""
        self.upload_parts(bucket, calls)
        self.compute(bucket, calls[0])

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        raise NotImplementedError

    def wait(self) -> None:
        pass

    def ready(self) -> bool:
        return True

    def outputs(self) -> dict[str, Any]:
        rows = self._rows
        return {name: out[:rows] for name, out in self._last.items()}

    def copy_outputs(self) -> dict[str, np.ndarray]:
        rows = self._rows
        return {name: _copy_out(out[:rows]) for name, out in self._last.items()}

    def copy_outputs_on_device(self) -> dict[str, Any]:
        raise AssertionError("a CPU context has no device outputs")

    def hold(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def buffer_sets(self) -> list[_Context]:
        """One: the host computes each run itself, so a second set would have nothing to overlap."""
        return [self]

    def close(self) -> None:
        self._flat.clear()
        self._views.clear()


def _remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    """Insert into a small cache that drops its oldest entry beyond ``_BINDING_CACHE``."""
    cache[key] = value
    if len(cache) > _BINDING_CACHE:
        cache.pop(next(iter(cache)))


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

    ``buffer_sets`` gives the context and ``BUFFER_SETS - 1`` lanes of it (``lane``): each has pinned
    staging, host outputs and a done event of its own, and shares the rest. A run queues its copy to
    the device, the model and the copy back on the one stream under ``_queueing``, so two sets'
    runs never interleave there; a set is used by one caller at a time and waited for before it is
    used again, so its staging is free when the host writes the next batch into it.

    Large host inputs (``_OVERLAPPED_COPY_BYTES``) are the exception: each set copies them on a copy
    stream of its own into device staging of its own, and the context's stream, once that copy is done,
    copies them on into the shared input buffers (device to device: 64 images of 224 x 224, 38.5 MB,
    in 0.02 ms on an H200, against 0.70 ms from pinned memory). So one context's copy of a batch
    overlaps the model run of the batch before it, as copies of two contexts already overlapped: on an
    H200, ``map`` of a ResNet-50-sized CNN with one context went from 0.78-0.81 of its bound (the
    slowest stage alone) to 0.95-1.00 (docs/benchmarks.md, "Session 10"). It costs each set device
    memory for the largest bucket's large inputs (2 x 38.5 MB per context for that CNN at 64), and a
    stream from torch's high-priority pool, apart from the contexts' own streams (a copy stream that were a
    context's stream could have other threads' copies captured into that context's CUDA graphs); past 32
    buffer sets in a process two share a copy stream, which only queues their copies one after the other.
    Outputs go back on the context's stream: for a segmenter whose outputs are seven times its inputs, a
    download stream of the context's own changed nothing on an H200, where copying the outputs out of pinned
    memory on the host took longer than the GPU's run and both copies (docs/benchmarks.md, "Session 11").
    """

    on_gpu = True
    overlaps = True  # the work is queued on the stream; the host waits only in ``wait``
    launches_on_host = False  # whether a run launches every kernel from the host, about as long as the GPU computes

    def __init__(self, spec: ModelSpec, buckets: Sequence[int], device: str, dtypes: dict[str, Any] | None,
                 order: _ComputeOrder | None) -> None:
        """``dtypes``: torch dtype per input; None takes the spec's (TensorRT passes the engine's).
        ``order``: the backend's compute order, or None for a backend whose run blocks the host (ONNX
        Runtime): holding a lock across a blocking run would serialize the contexts' copies too."""
        import torch

        if dtypes is None:
            dtypes = {i.name: getattr(torch, i.dtype) for i in spec.inputs}
        self._torch = torch
        self._order = order
        self._spec = spec
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self._done = torch.cuda.Event()
        self._batched = {i.name: bool(i.dims) and i.dims[0] == BATCH_DIM for i in spec.inputs}
        self._queueing = threading.RLock()  # shared by the lanes: one run at a time is queued on the stream
        self._device_flat: dict[tuple[int, str], torch.Tensor] = {}
        for b in buckets:
            values = _max_values(spec, b)
            for i in spec.inputs:
                # zeros: warm-up and capture read them, and zero is a valid token id, mask and pixel
                self._device_flat[b, i.name] = torch.zeros(math.prod(i.shape(values)), dtype=dtypes[i.name],
                                                           device=self.device)
        self._host_flat: dict[tuple[int, str], torch.Tensor] = {}
        self._host_np: dict[tuple[int, str], np.ndarray] = {}
        self._stage_buffers()
        self._views: dict[tuple[int, tuple[int, ...]], dict[str, tuple[Any, Any, np.ndarray]]] = {}
        self._host_out: dict[str, torch.Tensor] = {}
        self._last: dict[str, Any] = {}
        self._rows = 0
        self._computed: dict[str, Any] = {}

    def _stage_buffers(self) -> None:
        """This set's pinned staging, one per device input buffer; and for inputs that can be large, its copy stream
        and device staging (the largest bucket's size)."""
        torch = self._torch
        self._host_flat = {key: torch.zeros(flat.numel(), dtype=flat.dtype, pin_memory=True)
                           for key, flat in self._device_flat.items()}
        self._host_np = {key: flat.numpy() for key, flat in self._host_flat.items()}
        largest = max(bucket for bucket, _ in self._device_flat)
        self._device_stage: dict[str, Any] = {
            name: torch.empty_like(flat) for (bucket, name), flat in self._device_flat.items()
            if bucket == largest and flat.numel() * flat.element_size() >= _OVERLAPPED_COPY_BYTES}
        # from torch's high-priority pool: never a context's own stream (those come from the default pool)
        self._copy_stream = torch.cuda.Stream(self.device, priority=-1) if self._device_stage else self.stream
        self._copied = torch.cuda.Event()  # on the copy stream: this set's staging holds the batch
        self._stage_read = torch.cuda.Event()  # on the context's stream: its copies out of the staging are done

    def lane(self) -> _GpuContext:
        """Another buffer set of this context (see the class docstring): what ``Engines`` pools besides it."""
        other = copy.copy(self)  # shares the stream, device buffers, model, graphs and bindings
        other._stage_buffers()  # its own staging, copy stream and device staging
        other._views = {}
        other._host_out = {}
        other._last = {}
        other._computed = {}
        other._rows = 0
        other._done = self._torch.cuda.Event()
        return other

    def buffer_sets(self) -> list[_Context]:
        return [self, *(self.lane() for _ in range(BUFFER_SETS - 1))]

    def hold(self) -> contextlib.AbstractContextManager[Any]:
        return self._queueing

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
        caller = self._torch.cuda.current_stream(self.device)
        with self._queueing:
            if call.on_device:  # the feed was written on the caller's stream
                self.stream.wait_stream(caller)
            with self._torch.cuda.stream(self.stream):
                self._upload(bucket, call, start, stop)
                self._compute(bucket, call)
                self._download(host, caller)

    def upload(self, bucket: int, call: CheckedFeed, start: int, stop: int) -> None:
        with self._queueing:
            if call.on_device:
                self.stream.wait_stream(self._torch.cuda.current_stream(self.device))
            with self._torch.cuda.stream(self.stream):
                self._upload(bucket, call, start, stop)

    def compute(self, bucket: int, call: CheckedFeed) -> None:
        with self._queueing, self._torch.cuda.stream(self.stream):
            self._compute(bucket, call)

    def download(self, host: bool) -> None:
        caller = self._torch.cuda.current_stream(self.device)
        with self._queueing, self._torch.cuda.stream(self.stream):
            self._download(host, caller)

    def start(self, bucket: int, calls: Sequence[CheckedFeed], out: Mapping[str, np.ndarray] | None = None) -> None:
        """Each host feed's rows into this set's pinned staging at its offset (``_pack``), one copy to the device,
        ``compute`` and ``download(True)`` (into ``out``'s page-locked arrays where given), with no other set's run
        queued between them: what ``Engines.start_parts`` runs. The packing into this set's staging needs no
        lock: only the queueing waits for another set's."""
        views = self._pack_parts(bucket, calls)
        with self._queueing, self._torch.cuda.stream(self.stream):
            self._copy_parts(views)
            self._compute(bucket, calls[0])
            self._download(True, None, out)  # into host memory: no caller's stream owns the outputs

    def _pack_parts(self, bucket: int, calls: Sequence[CheckedFeed]) -> dict[str, tuple[Any, Any, np.ndarray]]:
        """The feeds' rows one after the other into this set's staging; its views (``_input_views``)."""
        first = calls[0]
        rows = sum(call.rows for call in calls)
        views = self._input_views(bucket, first)
        for name, (_, host_view, host_np) in views.items():
            if self._batched[name]:
                _pack([call.arrays[name] for call in calls], host_np[:rows])
            else:
                self.stage(host_np, host_view, first.arrays[name])
        self._rows = rows
        return views

    def _copy_parts(self, views: dict[str, tuple[Any, Any, np.ndarray]]) -> None:
        """Queue the copy of the packed rows to the device (under ``_queueing``, on the stream)."""
        rows = self._rows
        self._to_device([(name, device_view[:rows], host_view[:rows]) if self._batched[name] else
                         (name, device_view, host_view) for name, (device_view, host_view, _) in views.items()])

    def _to_device(self, copies: list[tuple[str, Any, Any]]) -> None:
        """Queue each (input, device target, pinned source) copy, on the context's stream (under ``_queueing``): a
        large one through this set's copy stream and device staging (the class docstring), the rest directly."""
        torch = self._torch
        staged = []
        for name, target, source in copies:
            stage = self._device_stage.get(name)
            if stage is None or source.numel() * source.element_size() < _OVERLAPPED_COPY_BYTES:
                target.copy_(source, non_blocking=True)
            else:
                staged.append((target, stage[:source.numel()].view(source.shape), source))
        if not staged:
            return
        self._copy_stream.wait_event(self._stage_read)  # the last batch through this staging has left it
        with torch.cuda.stream(self._copy_stream):
            for _, stage, source in staged:
                stage.copy_(source, non_blocking=True)
            self._copied.record(self._copy_stream)
        self.stream.wait_event(self._copied)
        for target, stage, _ in staged:
            target.copy_(stage, non_blocking=True)
        self._stage_read.record(self.stream)

    def _upload(self, bucket: int, call: CheckedFeed, start: int, stop: int) -> None:
        """Queue the copy of rows ``start:stop`` into the bucket's device inputs (through pinned memory); a
        device feed's stream has been waited for by the caller."""
        rows = stop - start
        views = self._input_views(bucket, call)
        from_host = []
        for name, (device_view, host_view, host_np) in views.items():
            batched = self._batched[name]
            source = call.arrays[name][start:stop] if batched else call.arrays[name]
            target = device_view[:rows] if batched else device_view
            if call.on_device:
                target.copy_(source, non_blocking=True)
                source.record_stream(self.stream)  # the caller's memory is read here, later
            else:
                pinned = host_view[:rows] if batched else host_view
                self.stage(host_np[:rows] if batched else host_np, pinned, source)
                from_host.append((name, target, pinned))
        self._to_device(from_host)
        self._rows = rows

    def _compute(self, bucket: int, call: CheckedFeed) -> None:
        """Queue the model run on the uploaded inputs, after the run any other context of the backend queued last."""
        rows = self._rows
        order = self._order
        if order is None:
            self._computed = {name: out[:rows] for name, out in self.execute(bucket, call).items()}
            return
        with order.lock:  # only the queueing is under the lock: it returns before the GPU is done
            self.stream.wait_event(order.done)
            self._computed = {name: out[:rows] for name, out in self.execute(bucket, call).items()}
            order.done.record(self.stream)

    def _download(self, host: bool, caller: Any, into: Mapping[str, np.ndarray] | None = None) -> None:
        """Queue the outputs' copy to this set's pinned host memory (``host``; or to the flat page-locked arrays of
        ``into`` that have room), or to new device tensors that the ``caller`` stream owns (the context's own
        outputs are the next run's, perhaps another set's)."""
        torch = self._torch
        if host:
            staged = {}
            for name, out in self._computed.items():
                target = into.get(name) if into else None
                pinned = None
                if target is not None and target.size >= out.numel():
                    pinned = torch.from_numpy(target[:out.numel()])
                    if pinned.dtype != out.dtype:
                        pinned = None
                if pinned is None:
                    pinned = self._pinned_output(name, out.numel(), out.dtype)[:out.numel()]
                pinned = pinned.view(out.shape)
                pinned.copy_(out, non_blocking=True)
                staged[name] = pinned.numpy()
            self._last = staged
        else:
            copies = {name: torch.empty_like(out) for name, out in self._computed.items()}  # on our stream
            for name, out in self._computed.items():
                copies[name].copy_(out, non_blocking=True)
                copies[name].record_stream(caller)  # the caller's stream uses them: freed, they wait for it
            self._last = copies
        self._done.record(self.stream)

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

    def ready(self) -> bool:
        """Whether the last run is done (``wait`` would return at once)."""
        return bool(self._done.query())

    def outputs(self) -> dict[str, Any]:
        return self._last

    def copy_outputs(self) -> dict[str, np.ndarray]:
        return {name: _copy_out(view) for name, view in self._last.items()}

    def copy_outputs_on_device(self) -> dict[str, Any]:
        """The last run's device outputs, copied at run time into fresh tensors (``_download``); waits for them."""
        self._done.synchronize()
        last, self._last = self._last, {}  # the caller's now: this set does not keep them alive
        return last

    def close(self) -> None:
        """Free the context: called on the context itself, never on its lanes (``Engines`` drops those)."""
        self.stream.synchronize()
        self._views.clear()
        self._device_flat.clear()
        self._host_flat.clear()
        self._host_np.clear()
        self._host_out.clear()
        self._device_stage.clear()


_PACK_GROUP_BYTES = 8 << 20  # a batch packed, or an output copied out, is split over threads in parts this large
_PACK_THREADS = max(1, min(4, (os.cpu_count() or 1) // 4))
_pack_pool: ThreadPoolExecutor | None = None
_pack_pool_lock = threading.Lock()
_in_pack_thread = threading.local()


def _pack(parts: list[np.ndarray], out: np.ndarray) -> None:
    """``np.concatenate(parts, out=out)``, by up to ``_PACK_THREADS`` threads for large batches (numpy releases the
    GIL while it copies). numpy, not torch: ``torch.cat`` into pinned memory took 140-740 ms for 64 images on a
    busy 2-core host (its thread pool oversubscribed), numpy 6 ms; one thread alone was 2 ms slower per batch of
    64 ResNet images than torch on the H200."""
    groups = min(_PACK_THREADS, len(parts), out.nbytes // _PACK_GROUP_BYTES)
    if groups <= 1:
        np.concatenate(parts, out=out, casting="same_kind")
        return
    offsets = [0, *itertools.accumulate(len(p) for p in parts)]  # row offsets of the parts in ``out``
    cuts = [len(parts) * g // groups for g in range(groups + 1)]  # parts per thread, about equal
    _in_parallel([functools.partial(np.concatenate, parts[a:b], out=out[offsets[a]:offsets[b]], casting="same_kind")
                  for a, b in itertools.pairwise(cuts)])


def _copy_out(view: np.ndarray) -> np.ndarray:
    """``view.copy()``, by up to ``_PACK_THREADS`` threads for a large output: the new array's pages are faulted in
    (and zeroed by the kernel) as they are first written. A segmenter's batch of 16 (67 MB out) took 19-21 ms with
    one thread and 12-13 ms with four on the H200's host; ``map`` 16-19 ms and 7.2-7.8 ms (docs/benchmarks.md)."""
    groups = min(_PACK_THREADS, view.nbytes // _PACK_GROUP_BYTES)
    if groups <= 1 or not view.flags.c_contiguous:
        return view.copy()
    out = np.empty_like(view)
    source, target = view.reshape(-1), out.reshape(-1)
    cuts = [len(source) * g // groups for g in range(groups + 1)]
    _in_parallel([functools.partial(np.copyto, target[a:b], source[a:b]) for a, b in itertools.pairwise(cuts)])
    return out


def _in_parallel(calls: list[Callable[[], Any]]) -> None:
    """Run ``calls`` on the pack threads and wait for them all (the first error, if any, is raised once every call has
    ended, so that none still writes the caller's buffers). In the calling thread, one after the other, where the pool
    cannot take them: the caller is one of its threads (waiting there for the pool could wait for itself), or the
    interpreter is shutting down (a server's daemon thread still answering)."""
    if getattr(_in_pack_thread, "yes", False):
        for call in calls:
            call()
        return
    jobs = []
    error: BaseException | None = None
    try:
        for call in calls:
            jobs.append(_pool().submit(call))
    except RuntimeError as err:
        if "shutdown" not in str(err):  # "cannot schedule new futures after (interpreter) shutdown" is the one we take
            error = err
        else:
            try:
                for call in calls[len(jobs):]:
                    call()
            except BaseException as failed:
                error = failed
    for job in jobs:  # every part ends before an error is raised: none may still write the caller's buffers
        try:
            job.result()
        except BaseException as failed:
            error = error or failed
    if error is not None:
        raise error


def _pool() -> ThreadPoolExecutor:
    """The threads that pack large batches and copy out large outputs (numpy releases the GIL while it copies)."""
    global _pack_pool
    with _pack_pool_lock:
        if _pack_pool is None:
            _pack_pool = ThreadPoolExecutor(_PACK_THREADS, thread_name_prefix="trtc-pack",
                                            initializer=_mark_pack_thread)
        return _pack_pool


def _mark_pack_thread() -> None:
    """A pack thread's initializer: ``_in_parallel`` called from it runs its parts there."""
    _in_pack_thread.yes = True


def _capture(stream: Any, launch: Callable[[], Any], what: str) -> tuple[Any, Any] | None:
    """Warm up ``launch`` on ``stream``, then capture it in a CUDA graph: (graph, what launch returned).

    None when capture fails (an op that cannot be captured, or a library call that synchronizes; ONNX
    Runtime raises its own exception types): the caller runs without a graph. Capture is thread-local
    and one at a time (``_CAPTURE_LOCK``): other threads may queue work on their own streams meanwhile.
    """
    import torch

    with _CAPTURE_LOCK:
        with torch.cuda.stream(stream):
            for _ in range(3):  # first runs allocate workspaces and pick kernels; a graph must not capture that
                launch()
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
                result = launch()
        except Exception as err:
            log.info("%s: CUDA graph capture failed (%s); running without a graph", what, first_line(err))
            return None
    return graph, result


# One capture at a time in the process: ``torch.cuda.graph`` synchronizes the device as it starts, which is invalid
# while another thread's stream is capturing (two contexts meeting a new shape at once).
_CAPTURE_LOCK = threading.Lock()
