"""Every default of trtc's settings, once.

The settings dataclasses (``compiler.core.settings``), the command-line options (their defaults and ``--help``
texts) and the profile schema derived from the dataclasses all read these names, so they cannot drift apart
(tests/compiler/core/test_defaults.py checks that they agree). As Torch-TensorRT's ``dynamo/_defaults.py``.
"""

from __future__ import annotations

__all__ = [
    "BUCKETS", "ATOL", "RTOL", "EXPORT_MIN_COSINE",
    "CALIB_SAMPLES", "CALIB_BATCH", "CALIB_METHOD", "FP8_CALIB_METHOD", "CALIB_METHODS", "PERCENTILE", "FP32_REST",
    "INT4_BLOCK", "INT4_MAX_FALLBACK", "INT4_METHOD", "INT4_METHODS", "AWQ_ROWS", "AWQ_GRID",
    "CALIB_MEMORY_BUDGET", "CALIB_DEVICE_MEMORY_FRACTION",
    "MAX_ACCURACY_DROP", "GATE_MIN_COSINE", "MAX_FALLBACK", "SENSITIVITY_SAMPLES",
    "PRECISION", "OPT_LEVEL", "HARDWARE_COMPAT", "TF32", "ENGINE", "JOBS", "MULTI_PROFILE", "VERSION_COMPATIBLE",
    "BENCH_ITERATIONS", "BENCH_MIN_SECONDS", "BENCH_WARMUP", "BENCH_WARMUP_SECONDS", "BENCH_SEED",
    "BENCH_MAX_SPREAD", "BENCH_MAX_REGRESSION", "BENCH_THREADS",
    "SERVE_BACKEND", "CONTEXTS", "CUDA_GRAPHS", "FREEZE_GC", "ORT_THREADS", "MAX_WAIT_MS", "SWITCH_INTERVAL_S",
    "DIFF_SAMPLES", "DIFF_TOP",
]

# --- export ---------------------------------------------------------------------------------------------------------
BUCKETS = (1, 4, 8, 16)  # batch sizes, one engine each; the largest bounds the dynamic batch
# The export check (compiler.frontend.verify): elementwise atol + rtol x |ref|, and a cosine floor. FP32 kernel
# noise on the zoo (tests/test_zoo.py: YOLO-, ViT-, BERT-, GPT-style and segmentation models) stays well inside
# these; a wrong operator in those models misses them by orders of magnitude.
ATOL = 1e-4
RTOL = 1e-3
EXPORT_MIN_COSINE = 0.9999

# --- calibration ----------------------------------------------------------------------------------------------------
CALIB_SAMPLES = 512  # at most this many calibration samples
CALIB_BATCH = 16  # samples per calibration batch
CALIB_METHOD = "percentile"
CALIB_METHODS = ("percentile", "max", "entropy", "mse")  # calibration.statistics.AMAX_METHODS implements each
PERCENTILE = 99.99  # of |x|, for the percentile method
# FP8 (E4M3) spans 448 / 2^-9 with 3 mantissa bits: its error is relative, not a fixed step, so clipping an outlier
# costs more than the range it spends; the largest |x| seen is its default range, as ModelOpt's FP8 calibration.
FP8_CALIB_METHOD = "max"
# weights per INT4 scale, along the reduction axis: all-MiniLM-L6-v2 reached cosine 0.983 at 32 against 0.975 at 128
# (AWQ, before the gate's fallback; benchmarks/precisions_modelopt.py), for 1/16 more bytes of scales
INT4_BLOCK = 32
# layers the INT4 gate may keep in FP16 unless --max-fallback says otherwise: a kept layer costs only file size
# (MiniLM needed 11 at block 32 and stayed at 0.36 of its FP32 size)
INT4_MAX_FALLBACK = 16
INT4_METHOD = "awq"  # calibration.int4.INT4_METHODS implements each
INT4_METHODS = ("awq", "rtn")
AWQ_ROWS = 512  # activation rows (tokens) per layer input kept to score AWQ's scale candidates
AWQ_GRID = 20  # scale exponents tried per layer: 0, 1/20, ..., 19/20, as the AWQ paper's grid
FP32_REST = False  # INT8: what is not quantized runs in FP16 (as ModelOpt), not FP32
# Bytes of exposed activations one ONNX Runtime run of calibration (or of the gate) may hold on the host: batches
# run in slices of samples within it, so memory does not grow with the batch.
CALIB_MEMORY_BUDGET = 64 << 20
# On a GPU, the calibrated activations of one ONNX Runtime run stay on the device and are binned there: a run
# may hold this fraction of the device's free memory of them (the host budget, 64 MiB, applies without a GPU).
# A quarter leaves room for ONNX Runtime's own activations, the binning's temporaries and the next run.
CALIB_DEVICE_MEMORY_FRACTION = 0.25

# --- accuracy gate --------------------------------------------------------------------------------------------------
MAX_ACCURACY_DROP = 0.5  # top-1 percentage points, with labels
GATE_MIN_COSINE = 0.99  # mean row cosine against FP32, without labels
MAX_FALLBACK = 8  # layers the gate may keep in higher precision
SENSITIVITY_SAMPLES = 64  # samples used to score each layer alone

# --- engine build ---------------------------------------------------------------------------------------------------
PRECISION = "fp32"
OPT_LEVEL = 3  # TensorRT builder optimization level, 0-5 (TensorRT's own default)
HARDWARE_COMPAT = "none"  # engines run on the GPU model that built them
TF32 = True  # FP32 layers may use TF32 tensor cores, as TensorRT and trtexec do
ENGINE = "tensorrt"
JOBS = 1
MULTI_PROFILE = False
VERSION_COMPATIBLE = False

# --- bench ----------------------------------------------------------------------------------------------------------
BENCH_ITERATIONS = 100  # at least this many timed runs per backend and bucket...
BENCH_MIN_SECONDS = 2.0  # ...and at least this long
BENCH_WARMUP = 10  # at least this many untimed runs first...
BENCH_WARMUP_SECONDS = 0.5  # ...and at least this long
BENCH_SEED = 0
BENCH_MAX_SPREAD = 0.2  # (P90 - P50) / P50 above this is reported as a wide spread
BENCH_MAX_REGRESSION = 0.05  # a fraction; --max-regression 5%
BENCH_THREADS = 0  # ONNX Runtime intra-op threads; 0: its own choice

# --- serving --------------------------------------------------------------------------------------------------------
SERVE_BACKEND = "auto"  # TensorRT where it is installed, else ONNX Runtime
CONTEXTS = 2  # execution contexts an Engines pools: batches that run at once
CUDA_GRAPHS = True  # replay a CUDA graph per bucket where the backend can capture one
FREEZE_GC = True  # load freezes the objects alive before it (compiler.serve.collector): no full collection stalls
ORT_THREADS = 0  # ONNX Runtime intra-op threads for serving; 0: its own choice (one sleeping thread per CUDA context)
MAX_WAIT_MS = 10.0  # how long a batcher's oldest request waits for others before its batch starts
# the interpreter's GIL switch interval while a DynamicBatcher runs (CPython's own is 5 ms): how long the threads
# that start and answer batches wait at most for the GIL behind a thread running Python (compiler.serve.switching)
SWITCH_INTERVAL_S = 0.0005

# --- diagnosis (trtc diff) ------------------------------------------------------------------------------------------
DIFF_SAMPLES = 256  # samples of the data trtc diff compares on (the digits' whole evaluation split is 300)
DIFF_TOP = 15  # layers in the printed table, worst first (diff.json has all)
