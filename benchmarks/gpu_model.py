"""A CPU model of the GPU serving path: ``Engines`` whose contexts do on the host what a GPU context does to the
host's threads and its GIL, with a simulated device that finishes each batch some milliseconds later.

What the serving code sees is what a GPU's contexts show it: ``on_gpu``, two buffer sets per context, ``start``
that packs the requests' rows into a set's staging on the caller's thread, ``ready()`` and ``wait()``. What the
host's threads do is what ``compiler.backends.gpu`` and ``compiler.backends.onnxrt`` do, in the same order:

* ``ort`` (ONNX Runtime's CUDA provider without CUDA graphs, ``OrtCudaContext``): ``start`` packs the rows on the
  caller's thread (``compiler.backends.copies.pack``, as ``GpuContext._pack_parts``) and hands the rest to a
  launcher thread of the context's own, shared by its buffer sets (``compiler.backends.onnxrt._Handoff``). The
  launcher holds the GIL for Python bookkeeping (torch's stream and device context managers, the copies' Python),
  releases it for each short torch call and for ONNX Runtime's run, which holds the launcher without the GIL for
  about as long as the device computes (it launches every kernel), while the device starts computing.
* ``graphs`` (CUDA graph replays: torch and ONNX Runtime with graphs, TensorRT): the same on the caller's thread,
  the run a short call without the GIL.

The device keeps one timeline per context's stream and one for the whole device (two contexts' runs share it), and
copies on a timeline of their own; ``ready()`` is true once the batch's end time has passed (a CUDA event's query
holds the GIL for a moment), ``wait()`` sleeps without the GIL until then. The model's output is a fixed function
of each row (its first values, doubled), so a misrouted answer shows.

The times are those of torchvision's ResNet-50 on an H200 (``Timing.resnet50_ort``: ONNX Runtime FP16, batch 64 in
about 6.6 ms end to end, launches about as long as the compute). This measures the serving code's threads, waits and
hand-offs, not a GPU: ``benchmarks/serving_cpu_model.py`` runs the batchers on it.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import copy
import functools
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from compiler.backends.base import Context, call_sizes, largest_sizes, remember
from compiler.backends.copies import copy_out, pack
from compiler.backends.feeds import CheckedFeed
from compiler.core.specs import BATCH_DIM, InputSpec, ModelSpec

__all__ = ["Timing", "ModelBackend", "model_engines", "OUTPUT_VALUES"]

OUTPUT_VALUES = 16  # values per output row: each row's first input values, doubled


@dataclass(frozen=True)
class Timing:
    """What one run costs, in milliseconds unless named otherwise.

    ``launch_ms``: how long a run holds the thread that queues it, without the GIL (ONNX Runtime's run launching
    every kernel; a graph's replay takes ``replay_ms``). ``gpu_ms`` + ``gpu_ms_per_row`` x bucket: the device's
    compute per batch. ``python_us``: GIL-held Python on the queueing thread per run, split by ``short_calls`` short
    calls without the GIL (``short_call_us`` each: torch's copies, event records). ``copy_gb_s``: host-to-device
    copies. ``launcher``: the run is handed to a launcher thread per context (ONNX Runtime without graphs)."""

    launch_ms: float = 3.5
    gpu_ms: float = 0.6
    gpu_ms_per_row: float = 0.055
    python_us: float = 80.0
    short_calls: int = 10
    short_call_us: float = 8.0
    copy_gb_s: float = 50.0
    launcher: bool = True
    replay_ms: float = 0.03
    shape_change_ms: float = 0.0

    @staticmethod
    def resnet50_ort() -> Timing:
        """ONNX Runtime FP16 without CUDA graphs, ResNet-50 at 3x224x224 on an H200 (its measured figures, scaled to
        the model's smaller rows: the device's time is the model's, not the copies')."""
        return Timing()

    @staticmethod
    def resnet50_graphs() -> Timing:
        """The same model as CUDA graph replays (torch, TensorRT): no launcher, a replay of a few microseconds."""
        return Timing(launcher=False, gpu_ms=0.8, gpu_ms_per_row=0.07)

    def scaled(self, factor: float) -> Timing:
        """Every device and launch time times ``factor`` (a slower or faster model)."""
        return replace(self, launch_ms=self.launch_ms * factor, gpu_ms=self.gpu_ms * factor,
                       gpu_ms_per_row=self.gpu_ms_per_row * factor)


class _Device:
    """The simulated GPU: when each stream and the device's compute are free (monotonic seconds)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.compute_free = 0.0
        self.copy_free = 0.0

    def copy(self, stream: _Stream, seconds: float) -> None:
        """Queue a copy on ``stream``: after the stream's last work, on the copy engine."""
        with self.lock:
            now = time.monotonic()
            start = max(now, stream.free, self.copy_free)
            self.copy_free = stream.free = start + seconds

    def compute(self, stream: _Stream, seconds: float, launch: float) -> float:
        """Queue a run on ``stream`` whose kernels are launched over ``launch`` seconds from now: it ends once the
        device has computed it after the stream's last work, and not before its last kernel is launched."""
        with self.lock:
            now = time.monotonic()
            start = max(now, stream.free, self.compute_free)
            stream.free = self.compute_free = max(start + seconds, now + launch + 20e-6)
            return stream.free


class _Stream:
    """A context's stream: when its queued work ends; ``synchronize`` sleeps until then (as CUDA's, without the
    GIL)."""

    def __init__(self) -> None:
        self.free = 0.0
        self.bucket = 0  # the bucket of the last run queued (a session's kernels keep per-shape state)

    def synchronize(self) -> None:
        left = self.free - time.monotonic()
        if left > 0:
            time.sleep(left)


def _python(us: float) -> None:
    """Hold the GIL in Python for ``us`` microseconds (interruptible at the switch interval, as Python code is)."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


_SCRATCH = (np.zeros(1 << 14, np.float32), np.zeros(1 << 14, np.float32))


def _short_call(us: float) -> None:
    """A short call without the GIL (numpy releases it to copy): what a torch copy or event record costs."""
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        np.copyto(_SCRATCH[0], _SCRATCH[1])


class ModelContext:
    """One buffer set of a modelled GPU context (``compiler.backends.base.Context``)."""

    on_gpu = True
    overlaps = True

    def __init__(self, backend: ModelBackend) -> None:
        self._backend = backend
        self._spec = backend.spec
        self._timing = backend.timing
        self.launches_on_host = self._timing.launcher
        self.start_hands_off = self._timing.launcher  # ``start`` hands the run to the launcher thread
        self._device = backend.device_model
        self._stream = self.stream = _Stream()
        self._queueing = threading.RLock()  # shared by the lanes, as ``GpuContext._queueing``
        self._launcher = (concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="trtc-ort-launch")
                          if self._timing.launcher else None)
        self._batched = {i.name: bool(i.dims) and i.dims[0] == BATCH_DIM for i in self._spec.inputs}
        self._stage_buffers()

    def _stage_buffers(self) -> None:
        self._host = {(b, i.name): np.zeros(int(np.prod(i.shape(largest_sizes(self._spec, b)))), np.float32)
                      for b in self._backend.buckets for i in self._spec.inputs}
        self._views: dict[tuple[int, tuple[int, ...]], dict[str, np.ndarray]] = {}
        self._out = np.zeros((max(self._backend.buckets), OUTPUT_VALUES), np.float32)
        self._done_at = 0.0
        self._rows = 0
        self._job: concurrent.futures.Future[None] | None = None

    def lane(self) -> ModelContext:
        other = copy.copy(self)  # shares the stream, the launcher and ``_queueing``
        other._stage_buffers()
        return other

    def buffer_sets(self) -> list[Context]:
        return [self, self.lane()]  # type: ignore[list-item]

    def _input_views(self, bucket: int, call: CheckedFeed) -> dict[str, np.ndarray]:
        views = self._views.get((bucket, call.key))
        if views is None:
            values = call_sizes(call, bucket)
            views = {}
            for i in self._spec.inputs:
                shape = i.shape(values)
                views[i.name] = self._host[bucket, i.name][:int(np.prod(shape))].reshape(shape)
            remember(self._views, (bucket, call.key), views)
        return views

    # -- what the batchers call --

    def start(self, bucket: int, calls: Sequence[CheckedFeed], out: Mapping[str, np.ndarray] | None = None) -> None:
        """``OrtCudaContext.start`` (launcher) or ``GpuContext.start`` (graphs): pack on the caller's thread, then
        queue the copy, the run and the copy back."""
        if self._job is not None and not self._job.done():  # a run never waited for still reads the staging
            concurrent.futures.wait([self._job])
        views = self._input_views(bucket, calls[0])
        rows = sum(call.rows for call in calls)
        for name, view in views.items():
            if self._batched[name]:
                pack([call.arrays[name] for call in calls], view[:rows])
            else:
                np.copyto(view, calls[0].arrays[name])
        self._rows = rows
        job = functools.partial(self._queue, bucket, views, rows)
        if self._launcher is None:
            job()
            self._job = None
        else:
            self._job = self._launcher.submit(job)

    def _queue(self, bucket: int, views: dict[str, np.ndarray], rows: int) -> None:
        """What ``_queue_parts`` does on the thread that queues the run: Python around short torch calls, the copy
        in, the run (launched without the GIL), the copy back."""
        timing = self._timing
        share = timing.python_us / (timing.short_calls + 1)
        with self._queueing:
            nbytes = sum(v[:rows].nbytes for v in views.values())
            for _ in range(timing.short_calls // 2):
                _python(share)
                _short_call(timing.short_call_us)
            self._device.copy(self._stream, nbytes / (timing.copy_gb_s * 1e9))
            launch = (timing.launch_ms if timing.launcher else timing.replay_ms) / 1e3
            if self._stream.bucket != bucket:  # the session's kernels set up again for another shape
                launch += timing.shape_change_ms / 1e3
                self._stream.bucket = bucket
            gpu = (timing.gpu_ms + timing.gpu_ms_per_row * bucket) / 1e3
            end = self._device.compute(self._stream, gpu, launch)
            time.sleep(launch)  # the run holds this thread, without the GIL, while it launches the kernels
            first = next(iter(views.values()))[:rows].reshape(rows, -1)
            self._out[:rows] = first[:, :OUTPUT_VALUES] * 2  # the "device" outputs, read once the run is queued
            for _ in range(timing.short_calls - timing.short_calls // 2):
                _python(share)
                _short_call(timing.short_call_us)
            _python(share)
            self._done_at = end + 10e-6  # the copy back

    def ready(self) -> bool:
        self._backend.looks += 1
        _python(2.0)  # cudaEventQuery, with the GIL held
        return (self._job is None or self._job.done()) and time.monotonic() >= self._done_at

    def wait(self) -> None:
        if self._job is not None:
            self._job.result()
        left = self._done_at - time.monotonic()
        if left > 0:
            time.sleep(left)  # an event's synchronize, without the GIL
        else:
            self._backend.late.append(-left)  # how long the batch was done before its waiter came

    def outputs(self) -> dict[str, np.ndarray]:
        return {self._backend.output_names[0]: self._out[:self._rows]}

    def copy_outputs(self) -> dict[str, np.ndarray]:
        return {name: copy_out(view) for name, view in self.outputs().items()}

    def copy_outputs_on_device(self) -> dict[str, Any]:
        raise AssertionError("the model has no device outputs")

    # -- engines(x), map and bench's stages: the whole run on the caller's thread, as ``GpuContext.run`` --

    def run(self, bucket: int, call: CheckedFeed, start: int, stop: int, host: bool) -> None:
        with self._queueing:
            self.upload(bucket, call, start, stop)
            self._queue_run(bucket)

    def _queue_run(self, bucket: int) -> None:
        views = self._input_views(bucket, CheckedFeed("numpy", {}, bucket, {}, ()))
        saved, self._launcher = self._launcher, None
        try:  # ``GpuContext.run`` queues the run on the caller's thread: no launcher
            self._queue(bucket, views, self._rows)
        finally:
            self._launcher = saved

    def upload(self, bucket: int, call: CheckedFeed, start: int, stop: int) -> None:
        rows = stop - start
        for name, view in self._input_views(bucket, call).items():
            source = call.arrays[name][start:stop] if self._batched[name] else call.arrays[name]
            np.copyto(view[:rows] if self._batched[name] else view, source)
        self._rows = rows

    def compute(self, bucket: int, call: CheckedFeed) -> None:
        self._queue_run(bucket)

    def download(self, host: bool) -> None:
        pass  # the run's copy back is modelled in ``_queue``

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        self._queue_run(bucket)
        return self.outputs()

    def hold(self) -> contextlib.AbstractContextManager[Any]:
        return self._queueing

    def close(self) -> None:
        if self._launcher is not None:
            self._launcher.shutdown(wait=True)


class ModelBackend:
    """A serving backend (``compiler.backends.base.Backend``) of modelled GPU contexts sharing one device."""

    name = "gpu-model"
    device = "model:0"  # not "cuda": ``Engines`` then asks torch for no stream

    def __init__(self, timing: Timing, buckets: Sequence[int] = (1, 16, 64), row: tuple[int, ...] = (3, 32, 32),
                 ) -> None:
        self.timing = timing
        self.buckets = tuple(sorted(buckets))
        self.spec = ModelSpec((InputSpec("images", (BATCH_DIM, *row), "float32"),))
        self.output_names = ["logits"]
        self.device_model = _Device()
        self.looks = 0  # ready() calls: a batcher's looks at a running batch
        self.late: list[float] = []  # seconds from a batch's end to its wait, where the wait came after the end

    def new_context(self) -> Context:
        return ModelContext(self)  # type: ignore[return-value]

    def close(self) -> None:
        pass


def model_engines(timing: Timing, contexts: int, buckets: Sequence[int] = (1, 16, 64),
                  row: tuple[int, ...] = (3, 32, 32)) -> Any:
    """``Engines`` over ``contexts`` modelled GPU contexts (two buffer sets each)."""
    from compiler.serve.engines import Engines

    return Engines(ModelBackend(timing, buckets, row), contexts)  # type: ignore[arg-type]


def reference(x: np.ndarray) -> np.ndarray:
    """What the model answers for rows ``x``."""
    return x.reshape(len(x), -1)[:, :OUTPUT_VALUES] * 2
