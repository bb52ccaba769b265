"""What a bench run measures: a build directory's manifest, its input spec, the eager model if it loads, and its
ONNX graphs, each checked against the manifest once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler.core.manifest import Manifest, verified_onnx
from compiler.core.specs import ModelSpec

__all__ = ["Target", "VerifiedOnnx"]


@dataclass
class VerifiedOnnx:
    """A build directory's ONNX graphs, each checked against the manifest's sha256 once and the path kept.

    One bench run asks for the FP32 graph up to three times (classifier check, reference, onnxruntime
    row); hashing gigabytes of weights each time only repeats the same answer. A check that fails is
    not kept: it raises again on the next call.
    """

    directory: Path
    manifest: Manifest
    _paths: dict[str, Path] = field(default_factory=dict)

    def path(self, precision: str) -> Path:
        """The checked graph of the manifest's ``onnx[precision]`` entry (which must exist)."""
        if precision not in self._paths:
            self._paths[precision] = verified_onnx(self.directory, self.manifest.onnx[precision], precision)
        return self._paths[precision]


@dataclass
class Target:
    """What is benchmarked: a build directory's manifest, its input spec, and the eager model if it loads."""

    directory: Path
    manifest: Manifest
    spec: ModelSpec
    model: Any  # nn.Module or None
    model_note: str  # why there is no model, or where it came from
    model_mode: bool  # True: `trtc bench model.pt`, a temporary export
    onnx: VerifiedOnnx  # the directory's graphs, each hashed once
