"""The ``torch`` serving backend: the source model in eager PyTorch, with a CUDA graph per bucket on
a GPU. For nodes with neither TensorRT nor a usable ONNX, and to measure the runtime itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any

from compiler.backends.base import Context, remember
from compiler.backends.feeds import CheckedFeed
from compiler.backends.gpu import ComputeOrder, GpuContext, capture_graph
from compiler.backends.host import HostContext
from compiler.core.specs import ModelSpec


class TorchBackend:
    name = "torch"

    def __init__(self, module: Any, spec: ModelSpec, buckets: Sequence[int], output_names: Sequence[str] | None,
                 device: str | None, cuda_graphs: bool, autocast_fp16: bool = False) -> None:
        """``autocast_fp16``: run under ``torch.autocast`` in FP16 (CUDA only; outputs as the model makes them)."""
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
        self.autocast = autocast_fp16 and target.type == "cuda"
        self.order = ComputeOrder() if target.type == "cuda" else None
        with contextlib.suppress(NotImplementedError):  # an ExportedProgram's module() has no eval(): runs as exported
            module = module.eval()
        self.module = module.to(target)
        probe = spec.example_feed(self.buckets[0])
        count = len(self.forward([torch.from_numpy(probe[n]).to(target) for n in spec.input_names]))
        names = list(output_names or [])
        self.output_names = names if len(names) == count else [f"output_{i}" for i in range(count)]

    def forward(self, args: list[Any]) -> list[Any]:
        import torch
        from torch.utils._pytree import tree_flatten

        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16, enabled=self.autocast):
            flat, _ = tree_flatten(self.module(*args))
        return flat

    def new_context(self) -> Context:
        if self.device == "cpu":
            return TorchCpuContext(self)
        return TorchCudaContext(self)

    def close(self) -> None:
        pass


class TorchCpuContext(HostContext):
    """Eager PyTorch on the CPU, reading the preallocated input arrays in place."""

    def __init__(self, backend: TorchBackend) -> None:
        super().__init__(backend.spec, backend.buckets)
        self._backend = backend

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        import torch

        args = [torch.from_numpy(view) for _, view, _ in self.input_views(bucket, call)]
        return {name: t.numpy() for name, t in zip(self._backend.output_names, self._backend.forward(args))}


class TorchCudaContext(GpuContext):
    """Eager PyTorch on the context's stream, with CUDA graphs: one per bucket, captured at load, for a model whose
    only dynamic dimension is the batch; one per bucket and size of the other dynamic dimensions (a sequence
    length), captured the first time that shape runs and kept for the last ``BINDING_CACHE`` shapes, for the rest.

    Without a graph the host launches every kernel in Python, holding the GIL: it is not free while
    the model runs (``overlaps`` False), so ``map`` runs such contexts in its sequential loop.
    """

    def __init__(self, backend: TorchBackend) -> None:
        assert backend.order is not None
        super().__init__(backend.spec, backend.buckets, backend.device, None, backend.order)
        self._backend = backend
        # (bucket, sizes of the other dynamic dims) -> (graph, its outputs), or None where capture failed
        self._graphs: dict[tuple[int, tuple[int, ...]], tuple[Any, dict[str, Any]] | None] = {}
        self._on_demand = backend.cuda_graphs and bool(backend.spec.dims)
        if backend.cuda_graphs and not backend.spec.dims:
            for b in backend.buckets:
                self._graphs[b, ()] = self._captured(b, CheckedFeed("numpy", {}, b, {}, ()))
        self.overlaps = self._on_demand or (
            bool(self._graphs) and all(g is not None for g in self._graphs.values()))

    def _args(self, bucket: int, call: CheckedFeed) -> list[Any]:
        inputs = self.device_inputs(bucket, call)
        return [inputs[name] for name in self._spec.input_names]

    def _captured(self, bucket: int, call: CheckedFeed) -> tuple[Any, dict[str, Any]] | None:
        captured = capture_graph(self.stream, functools.partial(self._backend.forward, self._args(bucket, call)),
                            f"bucket {bucket}" + (f" at {call.dims}" if call.dims else ""))
        return None if captured is None else (captured[0], dict(zip(self._backend.output_names, captured[1])))

    def execute(self, bucket: int, call: CheckedFeed) -> dict[str, Any]:
        key = (bucket, call.key)
        if key not in self._graphs and self._on_demand:
            # the inputs are already queued on our stream: capture reads them when it warms up, then the graph
            # replays below like every later call of this shape
            remember(self._graphs, key, self._captured(bucket, call))
        captured = self._graphs.get(key)
        if captured is not None:
            captured[0].replay()  # on the current stream: run() has made it the context's
            return captured[1]
        return dict(zip(self._backend.output_names, self._backend.forward(self._args(bucket, call))))
