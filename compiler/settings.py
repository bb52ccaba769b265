"""Frozen settings, one per stage, filled from the command line or a profile and validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from compiler.errors import InputError
from compiler.specs import ModelSpec

__all__ = ["ModelSource", "ExportSettings", "DEFAULT_BUCKETS"]

DEFAULT_BUCKETS = (1, 4, 8, 16)


@dataclass(frozen=True)
class ModelSource:
    path: Path | None = None
    factory: str | None = None
    weights: Path | None = None
    trust_pickle: bool = False

    def __post_init__(self) -> None:
        if not self.path and not self.factory:
            raise InputError("no model given: pass a model file or --model-factory pkg.module:make_model")
        if self.path and self.factory:
            raise InputError("give either a model file or --model-factory, not both")

    def describe(self) -> str:
        return str(self.path) if self.path else f"{self.factory}" + (f" + {self.weights}" if self.weights else "")


@dataclass(frozen=True)
class ExportSettings:
    source: ModelSource
    out: Path
    spec: ModelSpec | None = None  # None: read it from an ExportedProgram
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    opset: int | None = None
    rtol: float = 1e-4
    output_names: tuple[str, ...] = ()
    force: bool = False
    extra_verify_batches: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.rtol <= 0:
            raise InputError(f"--rtol {self.rtol} must be positive")
        if self.opset is not None and not 13 <= self.opset <= 23:
            raise InputError(f"--opset {self.opset}: trtc supports opsets 13 to 23 (Q/DQ per channel needs 13)")

    @property
    def max_batch(self) -> int:
        return max(self.buckets)

    @property
    def verify_batches(self) -> list[int]:
        return sorted({1, self.max_batch, *self.extra_verify_batches})
