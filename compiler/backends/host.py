"""The CPU's contexts: input buffers in host memory for every bucket (ONNX Runtime and eager PyTorch on the CPU)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from compiler.backends.base import Context, call_sizes, largest_sizes, remember
from compiler.backends.copies import copy_out
from compiler.backends.feeds import NUMPY_DTYPES, CheckedFeed
from compiler.core.specs import BATCH_DIM, ModelSpec

__all__ = ["HostContext"]


class HostContext:
    """Input buffers in host memory for every bucket at its largest shape; ``execute`` is the backend's."""

    on_gpu = False
    stream = None
    overlaps = True  # ONNX Runtime and torch release the GIL while they compute
    launches_on_host = False

    def __init__(self, spec: ModelSpec, buckets: Sequence[int]) -> None:
        self._spec = spec
        self._flat = {(b, i.name): np.zeros(math.prod(i.shape(largest_sizes(spec, b))), NUMPY_DTYPES[i.dtype])
                      for b in buckets for i in spec.inputs}
        self._views: dict[tuple[int, tuple[int, ...]], list[tuple[str, np.ndarray, bool]]] = {}
        self._last: dict[str, np.ndarray] = {}
        self._rows = 0

    def input_views(self, bucket: int, call: CheckedFeed) -> list[tuple[str, np.ndarray, bool]]:
        """Per input: (name, view of its buffer at the call's shape, whether it is batched)."""
        views = self._views.get((bucket, call.key))
        if views is None:
            values = call_sizes(call, bucket)
            views = []
            for i in self._spec.inputs:
                shape = i.shape(values)
                views.append((i.name, self._flat[bucket, i.name][:math.prod(shape)].reshape(shape),
                              bool(i.dims) and i.dims[0] == BATCH_DIM))
            remember(self._views, (bucket, call.key), views)
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
        return {name: copy_out(out[:rows]) for name, out in self._last.items()}

    def copy_outputs_on_device(self) -> dict[str, Any]:
        raise AssertionError("a CPU context has no device outputs")

    def hold(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def buffer_sets(self) -> list[Context]:
        """One: the host computes each run itself, so a second set would have nothing to overlap."""
        return [self]

    def close(self) -> None:
        self._flat.clear()
        self._views.clear()
