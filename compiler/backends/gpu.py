"""The GPU's contexts: device input buffers, pinned host staging and one CUDA stream per context (TensorRT, ONNX
Runtime's CUDA provider and eager PyTorch on a GPU), with ``ComputeOrder`` keeping the model runs of one backend's
contexts in sequence and ``capture_graph`` for CUDA graphs.

Each context has ``BUFFER_SETS`` buffer sets (``lane``): the host copies the next batch into one set's pinned
staging while the last batch, from the other set, runs on the GPU; large inputs go to the device on a copy stream
of the set's own.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from compiler.backends.base import Context, call_sizes, largest_sizes, remember
from compiler.backends.copies import copy_out, pack
from compiler.backends.feeds import CheckedFeed
from compiler.core.errors import first_line
from compiler.core.specs import BATCH_DIM, ModelSpec

if TYPE_CHECKING:
    import torch

__all__ = ["BUFFER_SETS", "ComputeOrder", "GpuContext", "capture_graph"]

log = logging.getLogger(__name__)

_PARALLEL_COPY_BYTES = 1 << 20  # inputs this large are staged with torch's multi-threaded copy
# Buffer sets (pinned staging and host outputs) per GPU context: with two, one context takes a second batch while
# its first runs (on an H200 one context and one set ran a CNN's batcher at 64-75 % of its bound: the 64 requests'
# copy into the set waited for the GPU).
BUFFER_SETS = 2
# Host inputs this large go to the device on their buffer set's own copy stream (``GpuContext._to_device``), so the
# copy overlaps the model run the context's stream is busy with; smaller ones, whose copy takes microseconds, stay on
# the context's stream without the extra device-to-device copy and two events.
OVERLAPPED_COPY_BYTES = 1 << 20


class ComputeOrder:
    """Orders the model runs of all contexts of one backend on the GPU, one after the other.

    Copies still overlap them (each context copies on its own stream), but two runs never share
    the GPU: measured on an H200, two CUDA graphs of a CNN replayed concurrently took 2.3 ms each
    instead of 1.3 ms, and then finished together, leaving nothing queued behind them.
    """

    def __init__(self) -> None:
        import torch

        self.lock = threading.Lock()
        self.done = torch.cuda.Event()  # recorded after the last run queued


class GpuContext:
    """Device input buffers per bucket (largest shape), pinned host staging, and the context's CUDA stream.

    Subclasses implement ``execute``: run on the device inputs, queued on ``self.stream``, and
    return the device outputs at the bucket's batch.

    ``buffer_sets`` gives the context and ``BUFFER_SETS - 1`` lanes of it (``lane``): each has pinned
    staging, host outputs and a done event of its own, and shares the rest. A run queues its copy to
    the device, the model and the copy back on the one stream under ``_queueing``, so two sets'
    runs never interleave there; a set is used by one caller at a time and waited for before it is
    used again, so its staging is free when the host writes the next batch into it.

    Large host inputs (``OVERLAPPED_COPY_BYTES``) are the exception: each set copies them on a copy
    stream of its own into device staging of its own, and the context's stream, once that copy is done,
    copies them on into the shared input buffers (device to device: 64 images of 224 x 224, 38.5 MB,
    in 0.02 ms on an H200, against 0.70 ms from pinned memory). So one context's copy of a batch
    overlaps the model run of the batch before it, as copies of two contexts already overlapped: on an
    H200, ``map`` of a ResNet-50-sized CNN with one context went from 0.78-0.81 of its bound (the
    slowest stage alone) to 0.95-1.00 (``benchmarks/serving_gpu.py``, the same host, in turns). It costs each set device
    memory for the largest bucket's large inputs (2 x 38.5 MB per context for that CNN at 64), and a
    stream from torch's high-priority pool, apart from the contexts' own streams (a copy stream that were a
    context's stream could have other threads' copies captured into that context's CUDA graphs); past 32
    buffer sets in a process two share a copy stream, which only queues their copies one after the other.
    Outputs go back on the context's stream: for a segmenter whose outputs are seven times its inputs, a
    download stream of the context's own changed nothing on an H200, where copying the outputs out of pinned
    memory on the host took longer than the GPU's run and both copies
    (``serving_gpu.py --models segmenter --map-only``).
    """

    on_gpu = True
    overlaps = True  # the work is queued on the stream; the host waits only in ``wait``
    launches_on_host = False  # whether a run launches every kernel from the host, about as long as the GPU computes
    start_hands_off = False  # whether ``start`` hands the run to a thread of the context's own (ONNX Runtime's)

    def __init__(self, spec: ModelSpec, buckets: Sequence[int], device: str, dtypes: dict[str, Any] | None,
                 order: ComputeOrder | None) -> None:
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
        self._largest = max(buckets)
        self._queueing = threading.RLock()  # shared by the lanes: one run at a time is queued on the stream
        self._device_flat: dict[tuple[int, str], torch.Tensor] = {}
        for b in buckets:
            values = largest_sizes(spec, b)
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
            if bucket == largest and flat.numel() * flat.element_size() >= OVERLAPPED_COPY_BYTES}
        # from torch's high-priority pool: never a context's own stream (those come from the default pool)
        self._copy_stream = torch.cuda.Stream(self.device, priority=-1) if self._device_stage else self.stream
        self._copied = torch.cuda.Event()  # on the copy stream: this set's staging holds the batch
        self._stage_read = torch.cuda.Event()  # on the context's stream: its copies out of the staging are done

    def lane(self) -> GpuContext:
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

    def buffer_sets(self) -> list[Context]:
        return [self, *(self.lane() for _ in range(BUFFER_SETS - 1))]

    def hold(self) -> contextlib.AbstractContextManager[Any]:
        return self._queueing

    def device_inputs(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        return {name: views[0] for name, views in self._input_views(bucket, call).items()}

    def _input_views(self, bucket: int, call: CheckedFeed) -> dict[str, tuple[Any, Any, np.ndarray]]:
        """Per input: (device view, pinned host view, numpy view of it) at the call's shape."""
        views = self._views.get((bucket, call.key))
        if views is None:
            values = call_sizes(call, bucket)
            views = {}
            for i in self._spec.inputs:
                shape = i.shape(values)
                numel = math.prod(shape)
                views[i.name] = (self._device_flat[bucket, i.name][:numel].view(shape),
                                 self._host_flat[bucket, i.name][:numel].view(shape),
                                 self._host_np[bucket, i.name][:numel].reshape(shape))
            remember(self._views, (bucket, call.key), views)
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
                pack([call.arrays[name] for call in calls], host_np[:rows])
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
            if stage is None or source.numel() * source.element_size() < OVERLAPPED_COPY_BYTES:
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
                    # room for the largest bucket at once: a set that grew its buffer with each larger batch paid a
                    # pinned allocation (cudaHostAlloc, milliseconds) on the requests of each
                    room = out.numel() // max(1, self._rows) * self._largest
                    pinned = self._pinned_output(name, max(out.numel(), room), out.dtype)[:out.numel()]
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
        return {name: copy_out(view) for name, view in self._last.items()}

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


def capture_graph(stream: Any, launch: Callable[[], Any], what: str) -> tuple[Any, Any] | None:
    """Warm up ``launch`` on ``stream``, then capture it in a CUDA graph: (graph, what launch returned).

    None when capture fails (an op that cannot be captured, or a library call that synchronizes; ONNX
    Runtime raises its own exception types): the caller runs without a graph. Capture is thread-local
    and one at a time (``CAPTURE_LOCK``): other threads may queue work on their own streams meanwhile.
    """
    import torch

    with CAPTURE_LOCK:
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
CAPTURE_LOCK = threading.Lock()
