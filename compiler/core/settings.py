"""Frozen settings, one per stage, filled from the command line or a profile and validated once."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from compiler.core import defaults
from compiler.core.errors import InputError
from compiler.core.specs import ModelSpec

__all__ = ["ModelSource", "ExportSettings", "BuildSettings", "ServeSettings", "Tolerance", "PRECISIONS",
           "HARDWARE_COMPAT_LEVELS", "SERVE_BACKENDS", "hardware_compat_level"]

@dataclass(frozen=True)
class Tolerance:
    """How far a candidate may be from its reference (see the module docstring for the rule)."""

    atol: float = defaults.ATOL
    rtol: float = defaults.RTOL
    min_cosine: float = defaults.EXPORT_MIN_COSINE

    def __post_init__(self) -> None:
        if self.atol < 0 or self.rtol < 0 or (self.atol == 0 and self.rtol == 0):
            raise InputError(f"--atol {self.atol:g} and --rtol {self.rtol:g} must be non-negative and not both 0")
        if not -1 <= self.min_cosine <= 1:
            raise InputError(f"minimum cosine {self.min_cosine:g} must lie in [-1, 1]")

    def __str__(self) -> str:
        return f"atol {self.atol:g} + rtol {self.rtol:g} x |ref|, cosine >= {self.min_cosine:g}"


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
    buckets: tuple[int, ...] = defaults.BUCKETS
    opset: int | None = None
    rtol: float = defaults.RTOL  # verification: |got - ref| <= atol * max(1, scale) + rtol * |ref|, see verify.py
    atol: float = defaults.ATOL
    output_names: tuple[str, ...] = ()
    force: bool = False
    extra_verify_batches: tuple[int, ...] = field(default=())

    def __post_init__(self) -> None:
        Tolerance(atol=self.atol, rtol=self.rtol)  # raises on bad values
        if self.opset is not None and not 13 <= self.opset <= 23:
            raise InputError(f"--opset {self.opset}: trtc supports opsets 13 to 23 (Q/DQ per channel needs 13)")

    @property
    def tolerance(self) -> Tolerance:
        return Tolerance(atol=self.atol, rtol=self.rtol)

    @property
    def max_batch(self) -> int:
        return max(self.buckets)

    @property
    def verify_batches(self) -> list[int]:
        return sorted({1, self.max_batch, *self.extra_verify_batches})


PRECISIONS = ("fp32", "fp16", "int8")
# TensorRT's HardwareCompatibilityLevel, as trtc spells it: "none" (the default) targets the GPU model the engine is
# built on; "same-compute-capability" any GPU of its compute capability; "ampere-plus" any GPU of capability 8.0+
HARDWARE_COMPAT_LEVELS = ("none", "same-compute-capability", "ampere-plus")


def hardware_compat_level(value: object) -> str:
    """A hardware-compatibility level from a setting or an older manifest (a bool there: True was AMPERE_PLUS)."""
    if value is None or value is False:
        return "none"
    if value is True:
        return "ampere-plus"
    level = str(value).strip().lower().replace("_", "-")
    if level not in HARDWARE_COMPAT_LEVELS:
        raise InputError(f"--hardware-compat {value!r}: use one of {', '.join(HARDWARE_COMPAT_LEVELS)}")
    return level


@dataclass(frozen=True)
class BuildSettings:
    """How engines are built. The precision is already in the ONNX graph (strongly typed networks)."""

    buckets: tuple[int, ...] = defaults.BUCKETS
    precision: str = defaults.PRECISION  # which ONNX of the directory the engines are built from
    multi_profile: bool = defaults.MULTI_PROFILE  # one engine, one optimization profile per bucket
    workspace_mib: int | None = None  # builder workspace limit; None = TensorRT's default (device memory)
    opt_level: int = defaults.OPT_LEVEL  # builder optimization level 0-5
    hardware_compat: str = defaults.HARDWARE_COMPAT  # a HARDWARE_COMPAT_LEVELS entry (HardwareCompatibilityLevel)
    version_compatible: bool = defaults.VERSION_COMPATIBLE  # engines later TensorRT versions can run
    timing_cache: Path | None = None  # shared across models; DIR/timing.cache is always used as well
    engine: str = defaults.ENGINE  # "tensorrt" | "none"
    jobs: int = defaults.JOBS  # parallel builds, one process per GPU
    # FP32 layers may use TF32 tensor cores (10 mantissa bits), as in TensorRT's and trtexec's default; False keeps
    # them strict FP32. Layers the graph puts in FP16/INT8 are not affected.
    tf32: bool = defaults.TF32

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise InputError(f"precision {self.precision!r}: use one of {', '.join(PRECISIONS)}")
        if not 0 <= self.opt_level <= 5:
            raise InputError(f"--opt-level {self.opt_level}: TensorRT's builder levels are 0 to 5")
        if self.workspace_mib is not None and self.workspace_mib < 1:
            raise InputError(f"--workspace {self.workspace_mib} MiB must be positive")
        if self.engine not in ("tensorrt", "none"):
            raise InputError(f"--engine {self.engine!r}: use tensorrt or none")
        object.__setattr__(self, "hardware_compat", hardware_compat_level(self.hardware_compat))
        if self.jobs < 1:
            raise InputError(f"--jobs {self.jobs} must be at least 1")


SERVE_BACKENDS = ("auto", "tensorrt", "onnxruntime", "torch")


@dataclass(frozen=True)
class ServeSettings:
    """How ``compiler.load`` serves a build directory; each field is documented at ``compiler.load``."""

    backend: str = defaults.SERVE_BACKEND
    device: str | None = None  # None: the GPU where the backend can use one
    contexts: int = defaults.CONTEXTS
    cuda_graphs: bool = defaults.CUDA_GRAPHS
    threads: int = defaults.ORT_THREADS
    trust_pickle: bool = False
    tf32: bool | None = None  # None: the manifest's build.tf32
    ort_cuda_options: Mapping[str, str] = field(default_factory=dict)
    precision: str | None = None  # None: the manifest's precision
    autocast_fp16: bool = False  # torch: run under FP16 autocast (CUDA only)

    def __post_init__(self) -> None:
        if self.backend not in SERVE_BACKENDS:
            raise InputError(f"backend={self.backend!r}: use one of {', '.join(SERVE_BACKENDS)}")
        if self.contexts < 1:
            raise InputError(f"contexts={self.contexts}: an Engines needs at least one execution context")
        if self.precision is not None and self.precision not in PRECISIONS:
            raise InputError(f"precision={self.precision!r}: use one of {', '.join(PRECISIONS)}")
