"""Eager PyTorch: the one function that runs a module (``eager_outputs``), the check runner the export
verification and bench's reference use (``TorchRunner``), and the ``torch`` serving backend: the source model,
with a CUDA graph per bucket on a GPU, for nodes with neither TensorRT nor a usable ONNX, and to measure the
runtime itself.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from compiler.backends.base import Context, Runner, remember
from compiler.backends.feeds import CheckedFeed
from compiler.backends.gpu import ComputeOrder, GpuContext, capture_graph
from compiler.backends.host import HostContext
from compiler.core.errors import InputError
from compiler.core.specs import ModelSpec

__all__ = ["eager_outputs", "eager_output", "names_of_outputs", "host_outputs", "TorchRunner", "TorchBackend",
           "TorchCpuContext", "TorchCudaContext"]


def eager_outputs(module: Any, args: Sequence[Any], autocast_fp16: bool = False) -> list[Any]:
    """``module(*args)`` in inference mode (under FP16 autocast on CUDA when asked), its outputs (a tensor, tuple,
    dict...) flattened in order: how trtc runs every eager model."""
    from torch.utils._pytree import tree_flatten

    flat, _ = tree_flatten(eager_output(module, args, autocast_fp16))
    return flat


def eager_output(module: Any, args: Sequence[Any], autocast_fp16: bool = False) -> Any:
    """``module(*args)`` in inference mode (under FP16 autocast on CUDA when asked), as it returns it."""
    import torch

    with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16, enabled=autocast_fp16):
        return module(*args)


def names_of_outputs(out: Any, input_names: list[str]) -> list[str] | None:
    """Names for a model's outputs where the user gave none, from what eager PyTorch returns (``out``): a dict's
    keys (a transformers ModelOutput's fields too), ``output_N`` for the N-th of a tuple or for a lone tensor
    (``output_0``), nested parts joined by ``_``; the ONNX export and the torch backend both name outputs so. The
    exporters' own names are their last node's (``linear_74``, ``mul_1178``), which serving code would have to
    use. None where a part is not a tensor or two names would clash (with each other or an input)."""
    import torch
    from torch.utils import _pytree as pytree

    try:
        leaves = pytree.tree_flatten_with_path(out)[0]
    except Exception:  # a container pytree cannot name its parts of: the exporters' names stay
        return None
    if not leaves or not all(isinstance(leaf, torch.Tensor) for _, leaf in leaves):
        return None
    names = []
    for index, (path, _) in enumerate(leaves):
        parts = [str(key.key) if isinstance(key, pytree.MappingKey) else str(key.idx)
                 if isinstance(key, pytree.SequenceKey) else getattr(key, "name", "") for key in path]
        name = re.sub(r"[^0-9A-Za-z_.]", "_", "_".join(parts))
        names.append(f"output_{name or index}" if not name or name[0].isdigit() else name)
    if len(set(names)) != len(names) or set(names) & set(input_names):
        return None
    return names


def host_outputs(flat: Sequence[Any], output_names: Sequence[str]) -> dict[str, np.ndarray]:
    """Flattened outputs on the host by name (``output_i`` when no names are given), floats as float32."""
    names = list(output_names) or [f"output_{i}" for i in range(len(flat))]
    if len(names) != len(flat):
        raise InputError(f"the model returned {len(flat)} tensors but the ONNX graph has {len(names)} outputs")
    return {n: t.detach().float().cpu().numpy() if t.is_floating_point() else t.detach().cpu().numpy()
            for n, t in zip(names, flat)}


class TorchRunner(Runner):
    """An eager PyTorch module as a check runner: the export checks' reference and bench's accuracy reference.

    Outputs come back on the host, named like the ONNX outputs (``output_names``), floats as float32.
    ``activate`` moves the module to ``device`` (in place, as ``nn.Module.to`` does); ``autocast_fp16`` runs
    under ``torch.autocast`` (CUDA only).
    """

    def __init__(self, module: Any, input_names: Sequence[str], output_names: Sequence[str] | None = None,
                 device: str = "cpu", autocast_fp16: bool = False) -> None:
        super().__init__()
        import torch

        self.module = module
        self._device = torch.device(device)
        self.device = self._device.type
        self.input_names = list(input_names)
        self.output_names = list(output_names or [])
        self.autocast = autocast_fp16 and self.device == "cuda"
        self.name = "torch" + ("[autocast-fp16]" if self.autocast else "")
        self._args: list[Any] = []
        self._flat: list[Any] = []

    def _activate(self) -> None:
        if hasattr(self.module, "to"):
            self.module = self.module.to(self._device)

    def _upload(self, feed: Mapping[str, np.ndarray]) -> None:
        import torch

        self._args = [torch.from_numpy(np.ascontiguousarray(feed[n])).to(self._device) for n in self.input_names]

    def _execute(self) -> None:
        self._flat = eager_outputs(self.module, self._args, self.autocast)

    def _download(self) -> dict[str, np.ndarray]:
        flat, self._flat, self._args = self._flat, [], []
        return host_outputs(flat, self.output_names)

    def _release(self) -> None:
        self._args, self._flat = [], []


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
        out = eager_output(self.module, [torch.from_numpy(probe[n]).to(target) for n in spec.input_names],
                           self.autocast)
        count = len(torch.utils._pytree.tree_flatten(out)[0])
        names = list(output_names or [])
        if len(names) != count:
            names = names_of_outputs(out, spec.input_names) or [f"output_{i}" for i in range(count)]
        self.output_names = names

    def forward(self, args: list[Any]) -> list[Any]:
        return eager_outputs(self.module, args, self.autocast)

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
