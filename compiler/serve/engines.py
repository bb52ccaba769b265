"""The serving pool: ``Engines``, what ``compiler.load(DIR)`` returns (``compiler.serve.load``); ``engines(x)`` or
``engines.map(batches, fn)``.

One call goes through these stages: check the feed against the manifest's input spec (names,
dtypes, fixed sizes, ranges of dynamic sizes), route the batch to the smallest bucket that holds
it (a batch over the largest bucket runs in chunks of the largest), copy it into that bucket's
preallocated input buffers, run, and copy the real rows of every output out. Padding rows keep
whatever the buffer held: every row is computed on its own, so they never reach a result.

Backends, behind one small interface (a backend makes contexts; a context owns one execution
context plus input and output buffers for every bucket; the contract is ``compiler.backends.base``, the
host and GPU contexts ``compiler.backends.host`` and ``compiler.backends.gpu``), one module each, made by name
through ``compiler.backends.registry``:

* ``tensorrt`` (``compiler.backends.tensorrt.runtime``): the directory's engines. ``execute_async_v3`` on
  the context's CUDA stream, tensor addresses bound once per buffer (torch tensors are the device
  buffers), pinned host buffers for the copies, and one CUDA graph per bucket, captured after
  warm-up, when no input has a dynamic non-batch dimension (a graph is only valid for the shapes
  it was captured with).
* ``onnxruntime`` (``compiler.backends.onnxrt``): the build's ONNX for the manifest's
  precision (``model.int8.onnx`` for ``precision: int8``), CUDA or CPU, through an IOBinding on
  the preallocated buffers; on CUDA its runs replayed as CUDA graphs where ONNX Runtime allows it.
* ``torch`` (``compiler.backends.pytorch``): the source model in eager PyTorch, with a CUDA graph per
  bucket on a GPU. For nodes with neither TensorRT nor a usable ONNX, and to measure the runtime
  itself.

``backend="auto"`` is TensorRT when it is installed, else ONNX Runtime, and then it says so once
in a log line, so that a service still starts on a node without TensorRT.

Thread safety: an ``Engines`` may be called from any number of threads. Each call borrows one
buffer set from a small pool and gives it back when its outputs are copied out; callers beyond
the pool wait for a free one. The pool: ``contexts`` (default 2, all created at load, so that
graph capture and allocation never land on a request), each with two buffer sets on a GPU
(``buffer_sets``: pinned staging and host outputs of their own, and a copy stream for large inputs,
sharing the context's device buffers, stream and model; their runs are queued on the stream one whole
run at a time), so the host copies one batch in while the context computes another; one set per
context on the CPU.

``trtc bench`` times these same backends (``Engines.runner``: one buffer set as a ``Runner``, its ``upload``,
``execute`` and ``download`` a context's own); there is no second way to run a model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.backends.base import Backend, Context, Runner
from compiler.backends.feeds import CheckedFeed, FeedChecker, as_kind
from compiler.core import defaults
from compiler.core.errors import FeedError, InputError
from compiler.core.specs import InputSpec, ModelSpec
from compiler.serve.runner import ContextRunner

__all__ = ["Engines", "Started"]

log = logging.getLogger(__name__)


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

    def __init__(self, backend: Backend, contexts: int = defaults.CONTEXTS) -> None:
        if contexts < 1:
            raise InputError(f"contexts={contexts}: an Engines needs at least one execution context")
        self._backend = backend
        self.spec: ModelSpec = backend.spec
        self.buckets: tuple[int, ...] = tuple(sorted(backend.buckets))
        self.output_names: list[str] = list(backend.output_names)
        self.input_names: list[str] = backend.spec.input_names
        self.name = f"trtc-runtime[{backend.name}]"
        self._feeds = FeedChecker(backend.spec)
        self._largest = largest = self.buckets[-1]
        self._sole_output = self.output_names[0] if len(self.output_names) == 1 else None
        # smallest bucket holding n rows, for n = 1 .. largest
        self._route = [0] + [next(b for b in self.buckets if b >= n) for n in range(1, largest + 1)]
        self._idle: queue.SimpleQueue[Context] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._max_contexts = contexts
        # all now: errors, allocation and graph capture at load, never on a request (a context created inside
        # ``map`` or under the batcher's first concurrent batch cost more than the batches it served)
        self._contexts: list[Context] = []
        try:
            for _ in range(contexts):
                self._contexts.append(backend.new_context())
            sets = [context.buffer_sets() for context in self._contexts]
        except BaseException:
            for context in self._contexts:
                context.close()
            raise
        self._sets = len(sets) * len(sets[0])
        for lane in zip(*sets, strict=True):  # the contexts' first sets first: calls at once go to different contexts
            for context in lane:
                self._idle.put(context)
        self._closed = False

    @property
    def contexts(self) -> int:
        """Execution contexts: how many batches the GPU (or the CPU) can run at once."""
        return self._max_contexts

    @property
    def buffer_sets(self) -> int:
        """How many calls can be in flight at once (each borrows one buffer set): two per context on a GPU, so
        that the host copies one batch in while the context runs another; one per context on the CPU."""
        return self._sets

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

    def runner(self, name: str | None = None, *, closing: bool = False) -> Runner:
        """One buffer set of the pool as a ``Runner`` (``compiler.backends.base``; ``compiler.serve.runner``), held
        by the caller from ``activate`` to ``release``: what ``trtc bench`` times, stage by stage. ``closing``:
        releasing the runner closes these engines too (a runner that owns them)."""
        return ContextRunner(self, name or self.backend, closing)

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
        for _ in range(self._sets):  # every buffer set given back: nothing runs any more
            self._idle.get()
        for context in self._contexts:
            context.close()
        self._backend.close()

    # -- calls --

    def __call__(self, x: Any) -> Any:
        single = type(x) is np.ndarray or (type(x) is not dict and not _is_mapping_type(type(x)))
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
                if call.kind == "torch" and single and self._sole_output is not None:  # one tensor, no dicts
                    return sys.modules["torch"].from_numpy(outputs[self._sole_output])  # imported: x is a tensor
                outputs = as_kind(outputs, call)
        else:
            outputs = self._run(call)
        if single and self._sole_output is not None:
            return outputs[self._sole_output]
        return outputs

    def run_parts(self, calls: Sequence[CheckedFeed]) -> dict[str, Any]:
        """Run checked feeds (``check``) with equal non-batch shapes as one batch: every output as one array,
        the parts' rows one after the other (host arrays; CUDA tensors for feeds on the GPU backend's device).

        What the batcher runs: each part's rows go straight into one context's (pinned) input buffers,
        so its requests are never packed into a batch array first. Feeds on a CUDA device, or more
        rows than the largest bucket, are joined (inputs without a batch dimension taken from the
        first part) and run as one ``engines(...)`` call.
        """
        started = self.start_parts(calls)
        assert started is not None  # it waits for a buffer set
        return started()

    def start_parts(self, calls: Sequence[CheckedFeed], *, wait: bool = True,
                    out: Mapping[str, np.ndarray] | None = None) -> Started | None:
        """``run_parts`` in two steps: queue the batch on a buffer set (copies and compute; on a GPU this returns
        while they run) and return the ``Started`` batch: calling it waits for the batch, gives the set back and
        returns the outputs. Call it exactly once. ``finish(read)`` instead returns ``read(outputs)`` with the
        outputs as views of the set's host buffers, valid only during that call: one copy fewer for a caller
        that copies them on anyway (the process batcher into its shared memory). ``finish.ready()`` says
        whether the call would return at once (the batchers start the next batch meanwhile).

        ``wait=False``: None at once when no buffer set is free. A caller that holds a started batch
        already passes it: two batchers sharing these engines would otherwise each hold a set and
        wait for the other's.

        ``out``: per output, a flat array of page-locked host memory (``cudaHostRegister``) with room for
        the batch at its largest shape: on a GPU the outputs are copied there instead of into the set's
        own buffers, and ``read`` gets views of it (the process batcher passes a region of its shared
        memory, where its clients read their answers). Ignored on the CPU, and for an output it has no
        room for."""
        rows = sum(call.rows for call in calls)
        free: Context | None = None
        if not wait:
            try:
                free = self._idle.get_nowait()
            except queue.Empty:
                return None
        if rows > self._largest or any(call.on_device for call in calls):
            if free is not None:
                self._idle.put(free)  # ``_run`` takes one itself (and may wait for it, as ``engines(x)`` does)
            first = calls[0].arrays
            joined = {c.name: _concatenate([call.arrays[c.name] for call in calls]) if c.batched else first[c.name]
                      for c in self._feeds.checks}
            outputs = self._run(self.check(joined))
            return Started(lambda read=None: outputs if read is None else read(outputs), lambda: True)
        bucket = self._route[rows]
        context = free if free is not None else self._acquire()
        try:
            context.start(bucket, calls, out)
        except BaseException:
            self._idle.put(context)
            raise

        def finish(read: Callable[[dict[str, np.ndarray]], Any] | None = None) -> Any:
            try:
                context.wait()
                return context.copy_outputs() if read is None else read(context.outputs())
            finally:
                self._idle.put(context)

        return Started(finish, context.ready)

    @property
    def queues_on_gpu(self) -> bool:
        """Whether ``start_parts`` returns while the GPU works (the batcher then starts its next batch first)."""
        return self._contexts[0].on_gpu

    @property
    def starts_at_once(self) -> bool:
        """Whether ``start_parts`` returns without holding the caller for about as long as the GPU computes, in every
        context: CUDA graph replays, TensorRT's enqueue (its kernels launched from C++), ONNX Runtime's run handed to
        its context's launcher thread; not eager torch, nor the CPU. (A torch graph captured on demand, where
        ``starts_at_once`` is True, still holds the first call at each new shape while it is captured.) That is, a
        GPU context whose host is free while the model runs (``overlaps``)."""
        return all(c.on_gpu and c.overlaps for c in self._contexts)

    @property
    def launches_on_host(self) -> bool:
        """Whether a run holds the host launching every kernel (no CUDA graphs: eager torch, ONNX Runtime where its
        runs could not be captured), in any context."""
        return any(c.launches_on_host or not c.overlaps for c in self._contexts)

    def check(self, x: Any) -> CheckedFeed:
        """Check a feed (one array or a dict by input name) against the spec; raises ``FeedError``.

        Returns the checked feed (its batch size in ``.rows``); the batcher checks requests with it.
        """
        return self._check(x, not isinstance(x, Mapping))

    def _check(self, x: Any, single: bool) -> CheckedFeed:
        call = self._feeds.check(x, single)
        if call.kind == "cuda":
            self._place(call)
        return call

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

    def _acquire(self) -> Context:
        try:
            return self._idle.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            if self._closed:
                raise RuntimeError("these engines are closed")
        return self._idle.get()

    def _release(self, context: Context) -> None:
        self._idle.put(context)

    @contextlib.contextmanager
    def borrow(self) -> Iterator[Context]:
        """One buffer set of the pool, with its context held, for the caller alone until the block ends (what ``trtc
        bench`` times: its ``upload``, ``compute`` and ``download`` are separate calls). Start no batch of these
        engines (``start_parts``, a batcher) from the same thread in the block: an ONNX Runtime context's launcher
        thread would wait for the context the block holds."""
        context = self._acquire()
        try:
            with context.hold():
                yield context
        finally:
            self._release(context)

    def bucket_for(self, rows: int) -> int:
        """The bucket a batch of ``rows`` runs in (at most the largest: larger batches run in chunks of it)."""
        return self._route[min(rows, self._largest)]

    def _run(self, call: CheckedFeed, stopped: Callable[[], bool] | None = None) -> dict[str, Any]:
        """Run ``call`` (in chunks of the largest bucket beyond it); raises ``_Stopped`` when ``stopped()`` turns
        true between two chunks (``map`` left early)."""
        context = self._acquire()
        try:
            largest = self.buckets[-1]
            if call.rows <= largest:
                return self._run_chunk(context, call, 0, call.rows)
            parts = []
            for start in range(0, call.rows, largest):
                if stopped is not None and stopped():
                    raise _Stopped
                parts.append(self._run_chunk(context, call, start, min(start + largest, call.rows)))
        finally:
            self._release(context)
        return {name: _concatenate([p[name] for p in parts]) for name in self.output_names}

    def _run_chunk(self, context: Context, call: CheckedFeed, start: int, stop: int) -> dict[str, Any]:
        host = not (call.on_device and context.on_gpu)
        context.run(self._route[stop - start], call, start, stop, host)
        if not host:
            return context.copy_outputs_on_device()
        context.wait()
        return as_kind(context.copy_outputs(), call)

    # -- pipelining --

    def map(self, batches: Iterable[Any], postprocess: Callable[[Any], Any] | None = None, *,
            depth: int = 2) -> Iterator[Any]:
        """Run every batch and yield ``postprocess(outputs)`` (or the outputs) in order.

        Each batch is what ``engines(...)`` takes, and ``postprocess`` gets what it returns. Batch
        n+1 is copied in and computed while batch n is post-processed: on a GPU backend with
        ``depth`` buffer sets (``buffer_sets``: pinned host buffers, queued on their context's
        CUDA stream), on a CPU backend with the compute in a second thread. A buffer set is given back as soon
        as its outputs are copied out, before ``postprocess`` runs, so post-processing never holds
        up the copies and compute of the next batches. Everything is synchronized before the last
        result is yielded; leaving the loop early stops the work (it waits up to a second for the thread that
        queues the batches, which may be inside the batch iterator). Where nothing would overlap (eager torch
        without CUDA graphs launches every kernel under the GIL; a one-core CPU; one GPU context whose runs
        launch every kernel from the host, as ONNX Runtime's without CUDA graphs) it is the plain loop, with
        no thread of its own; with two such contexts or more it hands the batches to their launcher threads
        in turn, so that their launches overlap (``_map_mode``).
        """
        if depth < 1:
            raise InputError(f"depth={depth}: map needs at least one buffer set")
        how = self._map_mode()
        if how == "loop":
            log.debug("map: %s cannot overlap batches here; running them one after the other", self.name)
            for batch in batches:
                value = self(batch)
                yield postprocess(value) if postprocess is not None else value
            return
        ready: queue.Queue[tuple[Any, ...]] = queue.Queue()
        in_flight = threading.Semaphore(depth)
        on_stream = self._callers_stream()  # device outputs are made for the consumer's stream
        stop = threading.Event()
        gate = threading.Lock()  # after the consumer stops (under it), no context enters ``ready``
        largest = self.buckets[-1]

        def submit() -> None:
            try:
                with on_stream():
                    submit_all()
            except BaseException as err:  # handed to the consumer, raised there in order
                ready.put(("error", err))

        def submit_all() -> None:
            for batch in batches:
                in_flight.acquire()  # the consumer releases it once more when it stops
                if stop.is_set():
                    return
                single = not isinstance(batch, Mapping)
                call = self.check(batch)
                if call.rows > largest:  # chunked: runs whole (unless the consumer stops), outputs copied out
                    try:
                        outputs = self._run(call, stop.is_set)
                    except _Stopped:
                        return
                    ready.put(("done", outputs, call, single))
                    continue
                context = self._acquire()
                try:
                    if how == "start" and not call.on_device:  # the run goes to the context's launcher thread
                        context.start(self._route[call.rows], [call])
                    else:
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
                        outputs = as_kind(context.copy_outputs(), call)
                finally:  # free for batch n+2 while batch n is post-processed
                    self._release(context)
                    in_flight.release()
                value = outputs[self.output_names[0]] if single and len(self.output_names) == 1 else outputs
                yield postprocess(value) if postprocess is not None else value
        finally:
            with gate:
                stop.set()
            in_flight.release()  # a submitter waiting for a buffer set wakes, and sees the stop
            while True:  # contexts the submitter queued before the consumer stopped
                try:
                    item = ready.get_nowait()
                except queue.Empty:
                    break
                if item[0] == "context":
                    item[1].wait()
                    self._release(item[1])
            # the submitter's last run: an interpreter that exits while it runs inside torch aborts ("terminate called
            # without an active exception", seen on a loop left early)
            worker.join(timeout=_SUBMITTER_JOIN)
            if worker.is_alive():
                log.debug("map: the batch iterator is still producing; its thread ends with it")


    def _callers_stream(self) -> Callable[[], contextlib.AbstractContextManager[Any]]:
        """What makes another thread queue on this thread's current CUDA stream (a no-op off the GPU)."""
        if not str(self._backend.device).startswith("cuda"):
            return contextlib.nullcontext
        torch = sys.modules["torch"]  # a GPU backend imported it
        stream = torch.cuda.current_stream(self._backend.device)
        return lambda: torch.cuda.stream(stream)

    def _map_mode(self) -> str:
        """How ``map`` runs here: "loop" (the plain loop: nothing would overlap, and the pipeline's threads only add
        hand-offs), "run" (a thread queues each batch, ``Context.run``, while the caller post-processes the last) or
        "start" (that thread hands each batch to its context's launcher thread, ``Context.start``, so that the
        contexts launch their kernels at once).

        The loop where the host cannot be free while a batch computes: a context that does not overlap (eager torch
        without CUDA graphs launches every kernel holding the GIL), one CPU core, one buffer set on a GPU (a batch's
        copy would wait for the last one's compute, so only post-processing could overlap: on an H200 that won
        nothing on average, map 0.75-1.31x the loop, ``serving_gpu.py``), and GPU contexts whose runs launch every
        kernel from the host with one launching thread for all batches (ONNX Runtime without CUDA graphs: the run
        holds the thread for about as long as the GPU computes, so a second batch could only wait behind the first's
        launch; the CPU model of it, ``benchmarks/serving_cpu_model.py``, ran map at 0.96-0.98x the loop, an H200 at
        0.85-0.88x with torchvision's ResNet-50). With two contexts or more whose ``start`` hands the run to a
        launcher thread of the context's own (``start_hands_off``), their launches overlap: "start"."""
        context = self._contexts[0]
        if not context.overlaps:
            return "loop"
        if not context.on_gpu:
            return "run" if (os.cpu_count() or 1) > 1 else "loop"
        if self._sets <= 1:
            return "loop"
        if self.launches_on_host:
            hands_off = all(getattr(c, "start_hands_off", False) for c in self._contexts)
            return "start" if hands_off and len(self._contexts) > 1 else "loop"
        return "run"


class _Stopped(Exception):
    """``map``'s consumer stopped while a batch ran in chunks (``Engines._run``)."""


_SUBMITTER_JOIN = 1.0  # seconds a map left early waits for its submitting thread (which may be in the batch iterator)
_MAPPING_TYPES: dict[type, bool] = {}  # the types of feeds seen, and whether each is a dict of inputs


@dataclass(frozen=True)
class Started:
    """A batch ``Engines.start_parts`` queued: ``started()`` (or ``started(read)``) finishes it, ``ready()`` says
    whether that would return at once."""

    finish: Callable[..., Any]
    ready: Callable[[], bool]

    def __call__(self, read: Callable[[dict[str, np.ndarray]], Any] | None = None) -> Any:
        return self.finish() if read is None else self.finish(read)


def _is_mapping_type(cls: type) -> bool:
    """``issubclass(cls, Mapping)``, remembered per type: the ABC check costs microseconds per call on a tensor."""
    known = _MAPPING_TYPES.get(cls)
    if known is None:
        known = issubclass(cls, Mapping)
        if len(_MAPPING_TYPES) < 64:
            _MAPPING_TYPES[cls] = known
    return known


def _concatenate(parts: list[Any]) -> Any:
    if isinstance(parts[0], np.ndarray):
        return np.concatenate(parts)
    import torch

    return torch.cat(parts)
