"""Thin runners for checks: a feed dict of numpy arrays in, a dict of numpy arrays by output name out.

Export verification, the accuracy gate (ONNX Runtime with Q/DQ run exactly as written, on the
CPU) and bench's accuracy reference use them; ``compiler.serve.engines.Engines`` has the same
``infer`` contract. Everything that is timed or served runs on the serving backends
(``compiler.backends``: ``trt``, ``onnxrt``, ``pytorch``): TensorRT, CUDA graphs and device buffers live there only.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from compiler.core.errors import InputError

__all__ = ["Runner", "OrtRunner", "TorchRunner", "check_feed"]

log = logging.getLogger(__name__)


class Runner(Protocol):
    name: str
    input_names: list[str]
    output_names: list[str]

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...

    def close(self) -> None: ...


def check_feed(feed: dict[str, np.ndarray], input_names: list[str]) -> None:
    missing = [n for n in input_names if n not in feed]
    extra = [n for n in feed if n not in input_names]
    if missing or extra:
        raise InputError(f"feed does not match the model's inputs {input_names}: missing {missing}, unknown {extra}")


class OrtRunner:
    """ONNX Runtime on an ONNX file (external data beside it) with the given providers."""

    def __init__(self, path: str | Path | Any, providers: list[str] | None = None, threads: int = 0,
                 exact_qdq: bool = False, memory_arena: bool = True) -> None:
        from compiler.core.onnx_io import ort_session, usable_providers

        self.providers = providers or usable_providers()
        self.session = ort_session(path, self.providers, threads=threads, exact_qdq=exact_qdq,
                                   memory_arena=memory_arena)
        self.name = f"onnxruntime[{self.session.get_providers()[0]}]"
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        gpu = self.session.get_providers()[0] in ("CUDAExecutionProvider", "TensorrtExecutionProvider")
        self.device = "cuda" if gpu else "cpu"

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        check_feed(feed, self.input_names)
        outputs = self.session.run(self.output_names, feed)
        return dict(zip(self.output_names, outputs))

    def close(self) -> None:
        del self.session


class TorchRunner:
    """An eager PyTorch module; outputs are flattened (tuples, dicts) in order and named like the ONNX outputs.

    ``autocast_fp16`` runs under ``torch.autocast`` (CUDA only); outputs come back as float32.
    """

    def __init__(self, module: Any, input_names: list[str], output_names: list[str] | None = None,
                 device: str = "cpu", autocast_fp16: bool = False) -> None:
        import torch

        self.module = module.to(device) if hasattr(module, "to") else module
        self._device = torch.device(device)
        self.device = self._device.type
        self.input_names = input_names
        self.output_names = output_names or []
        self.autocast = autocast_fp16 and self.device == "cuda"
        self.name = "torch" + ("[autocast-fp16]" if self.autocast else "")

    def infer(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        import torch

        check_feed(feed, self.input_names)
        args = [torch.from_numpy(np.ascontiguousarray(feed[n])).to(self._device) for n in self.input_names]
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.float16, enabled=self.autocast):
            out = self.module(*args)
        return _named_outputs(out, self.output_names)

    def close(self) -> None:
        pass


def _named_outputs(out: Any, output_names: list[str]) -> dict[str, np.ndarray]:
    """A module's outputs (a tensor, tuple, dict...) flattened in order, on the host, floats as float32."""
    from torch.utils._pytree import tree_flatten

    flat, _ = tree_flatten(out)
    names = output_names or [f"output_{i}" for i in range(len(flat))]
    if len(names) != len(flat):
        raise InputError(f"the model returned {len(flat)} tensors but the ONNX graph has {len(names)} outputs")
    return {n: t.detach().float().cpu().numpy() if t.is_floating_point() else t.detach().cpu().numpy()
            for n, t in zip(names, flat)}
