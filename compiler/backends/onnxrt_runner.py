"""ONNX Runtime as a check runner (``OnnxRuntimeRunner``): what export verification, the accuracy gate and bench's
reference without a PyTorch model run. The serving backend is ``compiler.backends.onnxrt``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from compiler.backends.base import Runner

__all__ = ["OnnxRuntimeRunner"]


class OnnxRuntimeRunner(Runner):
    """ONNX Runtime on an ONNX file or in-memory proto (external data beside it), with the given providers: what
    trtc's checks run. ``providers``: names or (name, options) pairs (default ``ort_providers()``); ``outputs``: the
    outputs to fetch (default all); the other options are ``compiler.core.onnx_io.ort_session``'s.
    """

    def __init__(self, model: str | Path | Any, providers: Sequence[Any] | None = None, *, threads: int = 0,
                 memory_arena: bool = True, outputs: Sequence[str] | None = None,
                 in_node_order: bool = False) -> None:
        super().__init__()
        self.model = model
        self.providers = list(providers) if providers else None
        self.threads, self.memory_arena = threads, memory_arena
        self.in_node_order = in_node_order
        self._wanted = list(outputs) if outputs is not None else None
        self.name = "onnxruntime"
        self.provider = ""
        self.session: Any = None
        self._feed: Mapping[str, np.ndarray] = {}
        self._outputs: list[np.ndarray] = []

    def _activate(self) -> None:
        from compiler.core.capabilities import ort_providers
        from compiler.core.onnx_io import ort_session

        self.providers = self.providers or ort_providers()
        self.session = ort_session(self.model, self.providers, threads=self.threads,
                                   memory_arena=self.memory_arena, in_node_order=self.in_node_order)
        self.provider = provider = self.session.get_providers()[0]  # what it runs on
        self.name = f"onnxruntime[{provider}]"
        self.device = "cuda" if provider in ("CUDAExecutionProvider", "TensorrtExecutionProvider") else "cpu"
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = self._wanted or [o.name for o in self.session.get_outputs()]

    def input_metadata(self) -> dict[str, tuple[str | None, tuple[int | str | None, ...] | None]]:
        """(ONNX Runtime's type, shape) by input name; a shape's dynamic dims are names or None."""
        return {i.name: (i.type, tuple(i.shape)) for i in self.session.get_inputs()}

    def _upload(self, feed: Mapping[str, np.ndarray]) -> None:
        self._feed = feed

    def _execute(self) -> None:
        self._outputs = self.session.run(self.output_names, dict(self._feed))

    def _download(self) -> dict[str, np.ndarray]:
        outputs, self._outputs, self._feed = self._outputs, [], {}
        return dict(zip(self.output_names, outputs))

    def _release(self) -> None:
        self.session = None
        self._feed, self._outputs = {}, []
