"""Every stage's settings, frozen and validated once: export, calibration and its gate, engine build, serving.

Each field a profile can set says so (``profiled``: its ``section.key``, the command-line option it comes from
and its meaning); ``compiler.core.profile`` derives the profile schema from these fields and merges a profile
with the command line (the command line wins). Defaults come from ``compiler.core.defaults``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from compiler.core import defaults
from compiler.core.errors import InputError
from compiler.core.specs import ModelSpec, parse_buckets

__all__ = ["ModelSource", "ExportSettings", "ImagePreprocessing", "GateSettings", "CalibrationSettings",
           "BuildSettings", "BenchSettings", "ServeSettings", "Tolerance", "ProfileKey", "profiled", "PRECISIONS",
           "REDUCED_PRECISIONS", "MIN_COMPUTE_CAPABILITY", "HARDWARE_COMPAT_LEVELS", "SERVE_BACKENDS", "BENCH_BACKENDS",
           "hardware_compat_level"]

PRECISIONS = ("fp32", "fp16", "int8", "fp8", "int4")
# what calibration makes, each a file of its own (model.<precision>.onnx); "int4" is INT4 weight-only (FP16 activations)
REDUCED_PRECISIONS = ("int8", "fp16", "fp8", "int4")
# the GPUs whose TensorRT kernels run a precision: (major, minor) compute capability at least, and who they are
MIN_COMPUTE_CAPABILITY = {"fp8": ((8, 9), "FP8 (E4M3) tensor cores: Ada, Hopper, Blackwell")}
# TensorRT's HardwareCompatibilityLevel, as trtc spells it: "none" (the default) targets the GPU model the engine is
# built on; "same-compute-capability" any GPU of its compute capability; "ampere-plus" any GPU of capability 8.0+
HARDWARE_COMPAT_LEVELS = ("none", "same-compute-capability", "ampere-plus")
SERVE_BACKENDS = ("auto", "tensorrt", "onnxruntime", "torch")
BENCH_BACKENDS = ("torch", "torch-cudagraph", "onnxruntime", "tensorrt")  # the rows of ``trtc bench``, in order


# --- how a field says where it comes from ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ProfileKey:
    """A profile key (``section.key``) that sets a settings field: its TOML types and what it means."""

    section: str
    key: str
    types: tuple[type, ...]
    meaning: str


def profiled(*keys: tuple[str, str, tuple[type, ...], str], option: str | None = None,
             convert: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Field metadata: the profile keys ``(section, key, TOML types, meaning)`` that set the field (none for a
    command-line-only field), the command-line option's name (default: the field's), and ``convert`` for a value
    as the profile or the command line gives it (a path string, a list)."""
    return {"profile": tuple(ProfileKey(*k) for k in keys), "option": option, "convert": convert}


def _path(value: Any) -> Path | None:
    return None if value is None else Path(value)


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


def _buckets(value: Any) -> tuple[int, ...]:
    return parse_buckets(list(value) if isinstance(value, (list, tuple)) else value)


def _names(value: Any) -> tuple[str, ...]:
    """``"a,b"`` (the command line's form) or a sequence of names, as a tuple."""
    parts = value.split(",") if isinstance(value, str) else value
    return tuple(p.strip() for p in parts if p.strip())


STR, NUMBER, INT, BOOL, LIST, TABLE = (str,), (float, int), (int,), (bool,), (list,), (dict,)


# --- export ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Tolerance:
    """How far a candidate may be from its reference (``compiler.frontend.verify`` states the rule)."""

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
    """Where the model comes from: a file, or a factory function (with a state dict)."""

    path: Path | None = field(default=None, metadata=profiled(
        ("model", "source", STR, "model file: TorchScript, ExportedProgram (.pt2), ONNX, or a pickle with "
         "trust_pickle"), option="model", convert=_path))
    factory: str | None = field(default=None, metadata=profiled(
        ("model", "factory", STR, "pkg.module:function returning an nn.Module (instead of source)"),
        option="model_factory"))
    weights: Path | None = field(default=None, metadata=profiled(
        ("model", "weights", STR, "state dict for the factory, loaded with weights_only=True"), convert=_path))
    trust_pickle: bool = field(default=False, metadata=profiled(
        ("model", "trust_pickle", BOOL, "allow loading a pickled nn.Module (runs arbitrary code)")))

    def __post_init__(self) -> None:
        if not self.path and not self.factory:
            raise InputError("no model given: pass a model file or --model-factory pkg.module:make_model")
        if self.path and self.factory:
            raise InputError("give either a model file or --model-factory, not both")

    def describe(self) -> str:
        return str(self.path) if self.path else f"{self.factory}" + (f" + {self.weights}" if self.weights else "")


@dataclass(frozen=True)
class ExportSettings:
    """How ``trtc export`` (and the export step of ``trtc build``) writes and verifies ``model.onnx``."""

    source: ModelSource
    out: Path = field(metadata=profiled(("build", "out", STR, "output directory"), convert=Path))
    spec: ModelSpec | None = field(default=None, metadata=profiled(  # None: read it from an ExportedProgram
        ("model", "inputs", LIST, 'input specs, e.g. ["images:Bx3x224x224:float32"]'),
        ("model", "dims", TABLE, 'ranges of non-batch dynamic dims, e.g. {S = "1:128:512"}')))
    buckets: tuple[int, ...] = field(default=defaults.BUCKETS, metadata=profiled(
        ("build", "buckets", LIST, "batch buckets"), convert=_buckets))
    opset: int | None = field(default=None, metadata=profiled(
        ("export", "opset", INT, "ONNX opset (default: the exporter's)")))
    # verification: |got - ref| <= atol * max(1, scale) + rtol * |ref| (compiler.frontend.verify)
    rtol: float = field(default=defaults.RTOL, metadata=profiled(
        ("export", "rtol", NUMBER, "verification, relative part: |got - ref| <= atol * max(1, scale) + rtol * |ref|"),
        convert=float))
    atol: float = field(default=defaults.ATOL, metadata=profiled(
        ("export", "atol", NUMBER, "verification, absolute part"), convert=float))
    output_names: tuple[str, ...] = field(default=(), metadata=profiled(
        ("model", "output_names", LIST, "names for the ONNX outputs"), convert=_strings))
    force: bool = field(default=False, metadata=profiled())
    extra_verify_batches: tuple[int, ...] = ()
    # --example-data: the inputs of the export and pass checks (compiler.frontend.example_data); command line only
    example_data: Path | None = field(default=None, metadata=profiled(convert=_path))

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


# --- calibration and the accuracy gate ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ImagePreprocessing:
    """How image files become an input tensor: resize the short side, center-crop, scale, normalize."""

    input: str | None = None  # which model input; default: the only image-shaped one
    size: int | None = None  # short side after resize; default: the crop size
    crop: tuple[int, int] | None = None  # (H, W); default: from the input spec
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    scale: float = 1 / 255
    layout: str = "NCHW"

    @classmethod
    def from_profile(cls, table: Mapping[str, Any]) -> ImagePreprocessing:
        """From the profile's ``calibration.image`` table (its keys are this class's fields)."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise InputError(f"calibration.image: unknown key {unknown[0]!r}; use {', '.join(sorted(known))}")
        values = dict(table)
        for key in ("crop", "mean", "std"):
            if key in values:
                values[key] = tuple(values[key])
        if values.get("layout", "NCHW") not in ("NCHW", "NHWC"):
            raise InputError("calibration.image.layout must be NCHW or NHWC")
        return cls(**values)


def _image(value: Any) -> ImagePreprocessing | None:
    if value is None or isinstance(value, ImagePreprocessing):
        return value
    return ImagePreprocessing.from_profile(value)


@dataclass(frozen=True)
class GateSettings:
    """What the accuracy gate accepts, and how far its fallback may go."""

    max_accuracy_drop: float = field(default=defaults.MAX_ACCURACY_DROP, metadata=profiled(
        ("calibration", "max_accuracy_drop", NUMBER, "top-1 points the gate allows, with labels"), convert=float))
    min_cosine: float = field(default=defaults.GATE_MIN_COSINE, metadata=profiled(
        ("calibration", "min_cosine", NUMBER, "cosine floor against FP32 without labels"), convert=float))
    max_fallback: int = field(default=defaults.MAX_FALLBACK, metadata=profiled(
        ("calibration", "max_fallback", INT, "layers the gate may keep in FP32"), convert=int))
    sensitivity_samples: int = defaults.SENSITIVITY_SAMPLES  # samples used to score each layer alone

    def __post_init__(self) -> None:
        if not -1 <= self.min_cosine <= 1:
            raise InputError(f"--min-cosine {self.min_cosine:g}: a cosine lies in [-1, 1]; use e.g. 0.99")
        if self.max_accuracy_drop > 100:  # a negative drop is a gain the gate demands: strict, not wrong
            raise InputError(f"--max-accuracy-drop {self.max_accuracy_drop:g}: top-1 points are at most 100; "
                             "use e.g. 0.5")
        if self.max_fallback < 0:
            raise InputError(f"--max-fallback {self.max_fallback}: a number of layers, at least 0")


@dataclass(frozen=True)
class CalibrationSettings:
    """How ``trtc calibrate`` (and the calibration step of ``trtc build``) makes and checks a reduced precision."""

    precision: str  # a REDUCED_PRECISIONS entry
    data: str | None = field(default=None, metadata=profiled(  # see calibration.data for the formats
        ("calibration", "data", STR, "calibration data: .npz/.npy file or folder, image folder, or 'random' "
         "(smoke tests)"), option="calib_data"))
    loader: str | None = field(default=None, metadata=profiled(
        ("calibration", "loader", STR, "pkg.module:function yielding {input_name: array} batches"),
        option="calib_loader"))
    samples: int = field(default=defaults.CALIB_SAMPLES, metadata=profiled(
        ("calibration", "samples", INT, "maximum number of samples"), option="calib_samples", convert=int))
    batch_size: int = field(default=defaults.CALIB_BATCH, metadata=profiled(
        ("calibration", "batch_size", INT, "samples per calibration batch"), option="calib_batch", convert=int))
    method: str = field(default="", metadata=profiled(  # "": the precision's default, set below
        ("calibration", "method", STR, f"{' | '.join(defaults.CALIB_METHODS)} (default {defaults.CALIB_METHOD}; "
         f"{defaults.FP8_CALIB_METHOD} for fp8)"), option="calib_method"))
    percentile: float = field(default=defaults.PERCENTILE, metadata=profiled(
        ("calibration", "percentile", NUMBER, "percentile for the percentile method"), convert=float))
    eval_data: str | None = field(default=None, metadata=profiled(  # default: the calibration data
        ("calibration", "eval_data", STR, "held-out data for the accuracy gate (default: the calibration data)")))
    labels: str | None = field(default=None, metadata=profiled(
        ("calibration", "labels", STR, "labels for the accuracy gate: .npy file, or the key in the .npz "
         "calibration data")))
    gate: GateSettings = field(default_factory=GateSettings)
    keep_fp32: tuple[str, ...] = field(default=(), metadata=profiled(
        ("calibration", "keep_fp32", LIST, "node names or op types kept in FP32"), convert=_strings))
    quantize_attention: bool = field(default=False, metadata=profiled())
    fp32_rest: bool = field(default=defaults.FP32_REST, metadata=profiled(  # INT8: the rest in FP32, not FP16
        ("calibration", "fp32_rest", BOOL, "int8: run what is not INT8 in FP32 instead of FP16"), convert=bool))
    calib_cache: Path | None = field(default=None, metadata=profiled(convert=_path))
    image: ImagePreprocessing | None = field(default=None, metadata=profiled(
        ("calibration", "image", TABLE, "image preprocessing: size, crop, mean, std, layout (NCHW/NHWC), input"),
        convert=_image))
    int4_block: int = field(default=defaults.INT4_BLOCK, metadata=profiled(
        ("calibration", "int4_block", INT, "int4: weights per INT4 scale along the reduction axis"), convert=int))
    int4_method: str = field(default=defaults.INT4_METHOD, metadata=profiled(
        ("calibration", "int4_method", STR, f"int4: {' | '.join(defaults.INT4_METHODS)} (awq: activation-aware "
         "scales from the calibration data; rtn: round to nearest)")))
    memory_budget: int = defaults.CALIB_MEMORY_BUDGET  # bytes of exposed activations per ONNX Runtime run

    def __post_init__(self) -> None:
        if self.precision not in REDUCED_PRECISIONS:
            raise InputError(f"precision {self.precision!r}: calibrate makes {' or '.join(REDUCED_PRECISIONS)}")
        if not self.method:
            object.__setattr__(self, "method", defaults.FP8_CALIB_METHOD if self.precision == "fp8"
                               else defaults.CALIB_METHOD)
        if self.samples < 1:
            raise InputError(f"--calib-samples {self.samples}: calibration needs at least one sample")
        if self.batch_size < 1:
            raise InputError(f"--calib-batch {self.batch_size}: a batch holds at least one sample")
        if self.method not in defaults.CALIB_METHODS:
            raise InputError(f"--calib-method {self.method!r}: use one of {', '.join(defaults.CALIB_METHODS)}")
        if not 50 < self.percentile <= 100:
            raise InputError(f"--percentile {self.percentile}: use a value in (50, 100], e.g. 99.99")
        if self.fp32_rest and self.precision != "int8":
            raise InputError("--fp32-rest applies to --int8 only (it keeps what INT8 leaves in FP32); drop it")
        if self.precision == "int4" and self.gate.max_fallback == defaults.MAX_FALLBACK:
            object.__setattr__(self, "gate", dataclasses.replace(self.gate, max_fallback=defaults.INT4_MAX_FALLBACK))
        if self.int4_method not in defaults.INT4_METHODS:
            raise InputError(f"--int4-method {self.int4_method!r}: use one of {', '.join(defaults.INT4_METHODS)}")
        if self.int4_block < 16 or self.int4_block & (self.int4_block - 1):
            raise InputError(f"--int4-block {self.int4_block}: use a power of two of at least 16 (e.g. 128), as "
                             "TensorRT's INT4 kernels take")


# --- engine build ---------------------------------------------------------------------------------------------------

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

    buckets: tuple[int, ...] = field(default=defaults.BUCKETS, metadata=profiled(convert=_buckets))
    precision: str = field(default=defaults.PRECISION, metadata=profiled(  # which ONNX the engines are built from
        ("build", "precision", STR, " | ".join(PRECISIONS))))
    multi_profile: bool = field(default=defaults.MULTI_PROFILE, metadata=profiled(  # one engine, a profile a bucket
        ("build", "multi_profile", BOOL, "one engine with one optimization profile per bucket"), convert=bool))
    workspace_mib: int | None = field(default=None, metadata=profiled(  # None: TensorRT's default (device memory)
        ("build", "workspace_mib", INT, "builder workspace limit in MiB"), option="workspace"))
    opt_level: int = field(default=defaults.OPT_LEVEL, metadata=profiled(
        ("build", "opt_level", INT, "builder optimization level 0-5"), convert=int))
    hardware_compat: str = field(default=defaults.HARDWARE_COMPAT, metadata=profiled(
        ("build", "hardware_compat", (bool, str), "none | same-compute-capability | ampere-plus (true: ampere-plus)"),
        convert=hardware_compat_level))
    version_compatible: bool = field(default=defaults.VERSION_COMPATIBLE, metadata=profiled(
        ("build", "version_compatible", BOOL, "build engines that later TensorRT versions can run"), convert=bool))
    timing_cache: Path | None = field(default=None, metadata=profiled(  # DIR/timing.cache is always used as well
        ("build", "timing_cache", STR, "timing cache shared across models"), convert=_path))
    engine: str = field(default=defaults.ENGINE, metadata=profiled(
        ("build", "engine", STR, "tensorrt | none")))
    jobs: int = field(default=defaults.JOBS, metadata=profiled(convert=int))  # parallel builds, one process per GPU
    # FP32 layers may use TF32 tensor cores (10 mantissa bits), as in TensorRT's and trtexec's default; False keeps
    # them strict FP32. Layers the graph puts in FP16/INT8 are not affected.
    tf32: bool = field(default=defaults.TF32, metadata=profiled(
        ("build", "tf32", BOOL, "FP32 layers may use TF32 tensor cores"), convert=bool))

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


# --- bench ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class BenchSettings:
    """How ``trtc bench`` measures. Seconds are wall-clock; fractions (``max_spread``, ``max_regression``) are 0-1."""

    backends: tuple[str, ...] = field(default=BENCH_BACKENDS, metadata=profiled(convert=_names))
    buckets: tuple[int, ...] = field(default=(), metadata=profiled(convert=tuple))  # empty: the build's buckets
    # at least this many timed runs per backend and bucket, and at least this long
    iterations: int = field(default=defaults.BENCH_ITERATIONS, metadata=profiled())
    min_seconds: float = field(default=defaults.BENCH_MIN_SECONDS, metadata=profiled())
    # stop a measurement (warm-up included) after this long; noted in the report
    max_seconds: float | None = field(default=None, metadata=profiled())
    # at least this many untimed runs first, and at least this long
    warmup: int = field(default=defaults.BENCH_WARMUP, metadata=profiled())
    warmup_seconds: float = field(default=defaults.BENCH_WARMUP_SECONDS, metadata=profiled())
    seed: int = field(default=defaults.BENCH_SEED, metadata=profiled())
    # an .npz with one array per input name (first axis = samples); None: seeded random
    data: Path | None = field(default=None, metadata=profiled(convert=_path))
    # empty: CUDA where usable, else the CPU; CPUExecutionProvider first: the CPU
    ort_providers: tuple[str, ...] = field(default=(), metadata=profiled(convert=_names))
    device: str | None = field(default=None, metadata=profiled())  # the torch backends': cuda or cpu; None: CUDA
    trust_pickle: bool = field(default=False, metadata=profiled(convert=bool))  # load a pickled nn.Module source
    max_spread: float = defaults.BENCH_MAX_SPREAD  # (P90 - P50) / P50 above this is reported as a wide spread
    baseline: Path | None = field(default=None, metadata=profiled(convert=_path))  # an earlier bench.json
    # slower P50 or lower throughput than the baseline by more than this fails
    max_regression: float = field(default=defaults.BENCH_MAX_REGRESSION, metadata=profiled())
    report_dir: Path | None = field(default=None, metadata=profiled(convert=_path))  # default DIR/report
    plot: bool = field(default=True, metadata=profiled(option="no_plot", convert=lambda no_plot: not no_plot))
    threads: int = field(default=defaults.BENCH_THREADS, metadata=profiled())  # ONNX Runtime intra-op; 0: its own
    # TF32 for FP32 math on every backend; None: the manifest's build.tf32, else True
    tf32: bool | None = field(default=None, metadata=profiled())
    wide: bool = field(default=False, metadata=profiled(convert=bool))  # every column in the terminal table

    def __post_init__(self) -> None:
        unknown = [b for b in self.backends if b not in BENCH_BACKENDS]
        if unknown or not self.backends:
            raise InputError(f"--backends {','.join(self.backends)}: choose from {','.join(BENCH_BACKENDS)}")
        if any(b < 1 for b in self.buckets):
            raise InputError(f"--buckets {self.buckets}: buckets are positive batch sizes")
        if self.iterations < 1:
            raise InputError(f"--iterations {self.iterations} must be at least 1")
        if self.warmup < 0 or self.warmup_seconds < 0 or self.min_seconds < 0:
            raise InputError("--warmup, --warmup-seconds and --min-seconds cannot be negative")
        if self.max_seconds is not None and self.max_seconds <= 0:
            raise InputError(f"--max-seconds {self.max_seconds} must be positive")
        if self.device not in (None, "cuda", "cpu"):
            raise InputError(f"--device {self.device!r}: use cuda or cpu")
        if not 0 <= self.max_regression < 10:
            raise InputError(f"--max-regression {100 * self.max_regression:g}%: give a percentage such as 5%")
        if self.data is not None and not Path(self.data).is_file():
            raise InputError(f"--data {self.data}: no such file; pass an .npz with one array per input")
        if self.baseline is not None and not Path(self.baseline).is_file():
            raise InputError(f"--baseline {self.baseline}: no such file; pass an earlier report/bench.json")

    def to_dict(self) -> dict[str, Any]:
        return {k: str(v) if isinstance(v, Path) else list(v) if isinstance(v, tuple) else v
                for k, v in asdict(self).items()}


# --- serving --------------------------------------------------------------------------------------------------------

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
