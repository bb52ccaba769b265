"""Measuring one plan at every bucket: its timing, peak device memory and accuracy, as ``BenchResult`` rows.

Peak device memory: for the torch backends, torch's allocator peak during the run less what was already
allocated, plus the model's weights; for TensorRT and ONNX Runtime on CUDA, the device-wide drop in free
memory since the runner was created (``cudaMemGetInfo``; other processes on the GPU disturb it); on the
CPU, not measured (None).

A backend that fails while running is a ``Skipped`` row marked failed, with the error, not a crash.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import numpy as np

from compiler.backends.base import Runner
from compiler.bench.accuracy import accuracy_of
from compiler.bench.inputs import first_line
from compiler.bench.plans import Plan
from compiler.bench.report import BenchResult, Skipped
from compiler.bench.timing import Latency, time_runner
from compiler.core.errors import TrtcError
from compiler.core.settings import BenchSettings
from compiler.serve.runner import BatchTooLarge

__all__ = ["RunContext", "measure_bucket", "measure_plan", "emulated", "EMULATED", "EMULATED_ON_CPU"]

log = logging.getLogger(__name__)


def _free_device_memory() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.mem_get_info()[0])


def _release_device_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def measure_bucket(plan: Plan, runner: Runner, bucket: int, feed: dict[str, np.ndarray],
                   reference: dict[str, np.ndarray], settings: BenchSettings, free_before_open: int | None,
                   context: RunContext) -> BenchResult:
    """Time ``runner`` at one bucket (CUDA work on the runner's stream) and compare its first outputs with
    ``reference``."""
    import torch

    cuda = runner.device == "cuda"
    resident = 0
    if cuda and plan.torch_memory:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = int(torch.cuda.memory_allocated())
    timing = time_runner(runner, feed, settings)
    memory: int | None = None
    method: str | None = None
    if cuda and plan.torch_memory:
        # what this run added to what was already allocated (weights, other runs' cuBLAS workspaces), plus weights
        memory = int(torch.cuda.max_memory_allocated()) - resident + plan.weight_bytes
        method = "torch.cuda.max_memory_allocated during the run, less what it found allocated, plus the weights"
    elif cuda and free_before_open is not None:
        free_now = _free_device_memory()
        if free_now is not None:
            memory, method = max(0, free_before_open - free_now), "device-wide cudaMemGetInfo delta since the " \
                                                                  "runner was created"
    latency, e2e = Latency.of(timing.device_ms), Latency.of(timing.e2e_ms)
    wide = latency.spread > settings.max_spread
    accuracy = accuracy_of(timing.outputs, reference, bucket, top1=context.classifier, data=context.data)
    result = BenchResult(
        backend=plan.backend, precision=plan.precision, bucket=bucket, runner=runner.name, device=runner.device,
        clock=timing.clock, iterations=len(timing.e2e_ms), seconds=round(timing.seconds, 4),
        stopped_early=timing.stopped_early, latency_ms=latency, e2e_ms=e2e,
        throughput=bucket * 1000.0 / latency.p50 if latency.p50 > 0 else float("inf"),
        e2e_throughput=bucket * 1000.0 / e2e.p50 if e2e.p50 > 0 else float("inf"),
        spread=latency.spread, cv=latency.cv, spread_wide=wide, peak_memory_bytes=memory, memory_method=method,
        accuracy=accuracy, dims=dict(context.dims[bucket]),
        accuracy_only=emulated(plan.backend, plan.precision, runner.device))
    log.info("%s bucket %d on %s: P50 %.3f ms (end to end %.3f ms), %d runs, cosine %.6f", result.name, bucket,
             runner.name, latency.p50, e2e.p50, result.iterations, accuracy.cosine)
    return result


# precisions ONNX Runtime runs only as written, not as the GPUs that have them do: their onnxruntime rows are accuracy
# rows (the accuracy of the graph TensorRT builds), their times no speed figure. By precision, on every provider;
# EMULATED_ON_CPU adds those the CPU provider alone emulates.
EMULATED = {
    "int8": "ONNX Runtime runs INT8 Q/DQ as written, quantize-dequantize around FP16/FP32 kernels (its fused integer "
            "kernels stay off: SESSION_POLICY)",
    "fp8": "ONNX Runtime runs FP8 Q/DQ as quantize-dequantize around FP16/FP32 math: no FP8 kernels",
    "int4": "ONNX Runtime dequantizes the INT4 weights on every run (its MatMulNBits kernel is kept off: it "
            "quantizes activations and changes results)",
}
EMULATED_ON_CPU = {
    "fp16": "ONNX Runtime's CPU provider has few FP16 kernels: it casts to FP32 and back around most nodes",
}


def emulated(backend: str, precision: str, device: str) -> str:
    """Why a row's times are no speed figure of its precision (it is an accuracy row), or "" for a speed row."""
    if backend != "onnxruntime":
        return ""
    return EMULATED.get(precision) or (EMULATED_ON_CPU.get(precision, "") if device == "cpu" else "")


@dataclass(frozen=True)
class RunContext:
    """What every measurement of one run shares: whether top-1 applies, where the inputs came from, dynamic dims."""

    classifier: bool
    data: str
    dims: dict[int, dict[str, int]]


def measure_plan(plan: Plan, buckets: tuple[int, ...], feeds: dict[int, dict[str, np.ndarray]],
                 reference: dict[int, dict[str, np.ndarray]], settings: BenchSettings, context: RunContext,
                 ) -> tuple[list[BenchResult], list[Skipped]]:
    """Measure one backend at every bucket, with one serving context opened for all of them. A failure is
    recorded (failed=True) with its error, not raised: the other backends still run, and the report and table
    show it."""
    results: list[BenchResult] = []
    skipped: list[Skipped] = []
    try:
        free_before = _free_device_memory()
        try:
            runner = plan.open()
            runner.activate()
        except _FAILURES as err:  # the runner shared by all buckets: each bucket would fail the same way
            return results, [Skipped(plan.backend, plan.precision, None, _failure(plan, buckets[0], err), failed=True)]
        with runner:
            for bucket in buckets:
                try:
                    results.append(measure_bucket(plan, runner, bucket, feeds[bucket], reference[bucket],
                                                  settings, free_before, context))
                except BatchTooLarge as why:
                    skipped.append(Skipped(plan.backend, plan.precision, bucket, str(why)))
                except _FAILURES as err:
                    skipped.append(Skipped(plan.backend, plan.precision, bucket, _failure(plan, bucket, err),
                                           failed=True))
    finally:
        _release_device_memory()
    return results, skipped


_FAILURES = (TrtcError, RuntimeError, OSError, ValueError, ImportError)  # a backend that fails is a row, not a crash


def _failure(plan: Plan, bucket: int, err: BaseException) -> str:
    """The report's reason for a failed backend, logged as a warning (the traceback at debug level)."""
    reason = f"failed: {type(err).__name__}: {first_line(err)}"
    log.warning("%s/%s at bucket %d %s", plan.backend, plan.precision, bucket, reason)
    log.debug("traceback", exc_info=True)
    return reason
