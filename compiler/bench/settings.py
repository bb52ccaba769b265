"""How ``trtc bench`` measures: ``BenchSettings``, validated once, and the names of the backends it can run."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from compiler.core import defaults
from compiler.core.errors import InputError

__all__ = ["BACKENDS", "BenchSettings"]


BACKENDS = ("torch", "torch-cudagraph", "onnxruntime", "tensorrt")


@dataclass(frozen=True)
class BenchSettings:
    """How ``trtc bench`` measures. Seconds are wall-clock; fractions (``max_spread``, ``max_regression``) are 0-1."""

    backends: tuple[str, ...] = BACKENDS
    buckets: tuple[int, ...] = ()  # empty: the build's buckets
    iterations: int = defaults.BENCH_ITERATIONS  # at least this many timed runs per backend and bucket...
    min_seconds: float = defaults.BENCH_MIN_SECONDS  # ...and at least this long
    max_seconds: float | None = None  # stop a measurement (warm-up included) after this long; noted in the report
    warmup: int = defaults.BENCH_WARMUP  # at least this many untimed runs first...
    warmup_seconds: float = defaults.BENCH_WARMUP_SECONDS  # ...and at least this long
    seed: int = defaults.BENCH_SEED
    data: Path | None = None  # an .npz with one array per input name (first axis = samples); None: seeded random
    ort_providers: tuple[str, ...] = ()  # empty: CUDA where usable, else the CPU; CPUExecutionProvider first: the CPU
    device: str | None = None  # for the torch backends: "cuda" or "cpu"; None: CUDA when present
    trust_pickle: bool = False  # load a pickled nn.Module source (runs code from the file)
    max_spread: float = defaults.BENCH_MAX_SPREAD  # (P90 - P50) / P50 above this is reported as a wide spread
    baseline: Path | None = None  # an earlier bench.json of the same build
    # slower P50 or lower throughput than the baseline by more than this fails
    max_regression: float = defaults.BENCH_MAX_REGRESSION
    report_dir: Path | None = None  # default DIR/report
    plot: bool = True
    threads: int = defaults.BENCH_THREADS  # ONNX Runtime intra-op threads; 0: its default
    tf32: bool | None = None  # TF32 for FP32 math on every backend; None: the manifest's build.tf32, else True
    wide: bool = False  # the terminal table with every column (the files always have them)

    def __post_init__(self) -> None:
        unknown = [b for b in self.backends if b not in BACKENDS]
        if unknown or not self.backends:
            raise InputError(f"--backends {','.join(self.backends)}: choose from {','.join(BACKENDS)}")
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
