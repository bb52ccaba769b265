"""The one contract for what runs a model: ``Runner`` (run one model on a feed), and the serving pool's
``Backend`` and ``Context`` (execution contexts with buffers for every bucket, which ``Engines`` pools).

``Runner`` follows Polygraphy's ``backend/base/runner.py``: ``activate`` it (or use ``with``), call
``infer(feed)`` with a dict of numpy arrays by input name (the feed is checked once, here), ``release``
it. ``infer`` is three stages that ``trtc bench`` times apart: ``upload`` (the feed into the runner's
buffers), ``execute`` (the model run, queued on ``stream`` on a GPU) and ``download`` (the outputs back
to the host, waited for). Every backend gives a runner through ``compiler.backends.registry``: export
verification and the accuracy gate run the ONNX Runtime and eager-PyTorch check runners, ``trtc bench``
times one context of each serving backend (``compiler.serve.engines.Engines.runner``).

A serving ``Backend`` makes ``Context``s; ``Engines`` pools them, routes each batch to a bucket and
pads it. The contexts that hold the buffers are ``compiler.backends.host.HostContext`` (CPU) and
``compiler.backends.gpu.GpuContext`` (device buffers, pinned staging, a CUDA stream per context).
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from compiler.backends.feeds import CheckedFeed, mismatch
from compiler.core.specs import BATCH_DIM, ModelSpec

__all__ = ["Runner", "Context", "Backend", "largest_sizes", "call_sizes", "remember", "BINDING_CACHE"]

BINDING_CACHE = 32  # (bucket, dynamic sizes) combinations whose views and bindings a context keeps


class Runner(abc.ABC):
    """Runs one model (see the module docstring): ``with runner: outputs = runner.infer(feed)``.

    Subclasses give ``input_names`` and ``output_names`` (after ``activate``), and implement ``_activate``,
    ``_upload``, ``_execute``, ``_download`` and ``_release``. ``device`` is ``cpu`` or ``cuda``; ``stream`` the
    CUDA stream ``execute`` queues on (None on the CPU), which the harness brackets with CUDA events.
    """

    name: str = "runner"
    device: str = "cpu"
    stream: Any = None
    input_names: list[str]
    output_names: list[str]

    def __init__(self) -> None:
        self.is_active = False

    def activate(self) -> None:
        """Load what the runner needs (a session, a model on its device, a context); once."""
        if not self.is_active:
            self._activate()
            self.is_active = True

    def release(self) -> None:
        """Free what ``activate`` took; the runner may be activated again."""
        if self.is_active:
            self.is_active = False
            self._release()

    def __enter__(self) -> Runner:
        self.activate()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def input_metadata(self) -> dict[str, tuple[str | None, tuple[int | str | None, ...] | None]]:
        """(dtype, shape) by input name, as far as the runner knows them (None: unknown); a shape's dynamic
        dimensions are names or None."""
        return {name: (None, None) for name in self.input_names}

    def infer(self, feed: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The model's outputs by name for ``feed`` (numpy arrays by input name): upload, execute, download."""
        self.upload(feed)
        self.execute()
        return self.download()

    def upload(self, feed: Mapping[str, np.ndarray]) -> None:
        """Check ``feed`` (``check``) and copy it into the runner's buffers (on a GPU: queue the copy)."""
        if not self.is_active:
            raise RuntimeError(f"{self.name}: activate the runner first (or use it in a with-block)")
        self._upload(self.check(feed))

    def check(self, feed: Mapping[str, np.ndarray]) -> Any:
        """The feed as ``_upload`` takes it, after the one check of it: here its names against the model's inputs
        (``FeedError`` naming what is missing or unknown); a runner that knows the input spec checks it all."""
        if len(feed) != len(self.input_names) or any(feed.get(n) is None for n in self.input_names):
            raise mismatch(self.input_names, feed)
        return feed

    def execute(self) -> None:
        """Run the model on the uploaded feed (on a GPU: queue it on ``stream``)."""
        self._execute()

    def download(self) -> dict[str, np.ndarray]:
        """The last run's outputs on the host by output name, once they are done."""
        return self._download()

    @abc.abstractmethod
    def _activate(self) -> None: ...

    @abc.abstractmethod
    def _upload(self, feed: Any) -> None: ...

    @abc.abstractmethod
    def _execute(self) -> None: ...

    @abc.abstractmethod
    def _download(self) -> dict[str, np.ndarray]: ...

    @abc.abstractmethod
    def _release(self) -> None: ...


class Context(Protocol):
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

    def buffer_sets(self) -> list[Context]: ...

    def close(self) -> None: ...


class Backend(Protocol):
    """A serving backend: its model loaded once, and ``new_context`` for each execution context ``Engines`` pools
    (each with buffers for every bucket). ``device``: ``cpu`` or ``cuda:N``."""

    name: str
    device: str
    spec: ModelSpec
    buckets: tuple[int, ...]
    output_names: list[str]

    def new_context(self) -> Context: ...

    def close(self) -> None: ...


def largest_sizes(spec: ModelSpec, bucket: int) -> dict[str, int]:
    """Every dimension's size at the bucket's largest shape: the batch at ``bucket``, dynamic dims at their max."""
    values = {name: r.max for name, r in spec.dims.items()}
    values[BATCH_DIM] = bucket
    return values


def call_sizes(call: CheckedFeed, bucket: int) -> dict[str, int]:
    """Every dimension's size for a call run in ``bucket``: the batch padded to the bucket, dynamic dims as fed."""
    values = dict(call.dims)
    values[BATCH_DIM] = bucket
    return values


def remember(cache: dict[Any, Any], key: Any, value: Any) -> None:
    """Insert into a small cache that drops its oldest entry beyond ``BINDING_CACHE``."""
    cache[key] = value
    if len(cache) > BINDING_CACHE:
        cache.pop(next(iter(cache)))
