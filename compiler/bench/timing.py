"""Timing one runner at one feed: ``time_runner`` and what it measures (``Timing``, ``Latency``).

Warm-up of at least ``warmup`` runs and ``warmup_seconds``, then at least ``iterations`` runs and at
least ``min_seconds`` (``max_seconds`` caps both; stopping early is noted). Every run is the runner's three
stages (``compiler.backends.base.Runner``): upload the feed, execute, download the outputs. The host clock
(``perf_counter_ns``) around all three is the *end-to-end* latency; execute alone is the *device* latency,
timed with CUDA events on the runner's stream on a GPU and with the host clock on the CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from compiler.backends.base import Runner
from compiler.core.settings import BenchSettings

__all__ = ["Latency", "Timing", "as_float32", "time_runner"]


@dataclass(frozen=True)
class Latency:
    """Latency statistics in milliseconds."""

    p50: float
    p90: float
    p99: float
    mean: float
    std: float
    min: float
    max: float

    @classmethod
    def of(cls, ms: list[float]) -> Latency:
        a = np.asarray(ms, dtype=np.float64)
        p50, p90, p99 = (float(v) for v in np.percentile(a, [50, 90, 99]))
        return cls(p50, p90, p99, float(a.mean()), float(a.std()), float(a.min()), float(a.max()))

    @property
    def spread(self) -> float:
        """(P90 - P50) / P50: how far the slow tail is from the typical run."""
        return (self.p90 - self.p50) / self.p50 if self.p50 > 0 else 0.0

    @property
    def cv(self) -> float:
        """Coefficient of variation, std / mean."""
        return self.std / self.mean if self.mean > 0 else 0.0


@dataclass(frozen=True)
class Timing:
    """What ``time_runner`` measured: device and end-to-end latency of each timed run, and the first outputs."""

    device_ms: list[float]
    e2e_ms: list[float]
    clock: str  # "cuda_event" or "perf_counter_ns" (for the device latency; end-to-end is always perf_counter_ns)
    seconds: float
    warmup_runs: int
    stopped_early: bool
    outputs: dict[str, np.ndarray]


def as_float32(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Float outputs as float32 (an FP16 build's outputs compare with the FP32 reference), others as they are."""
    return {name: a.astype(np.float32) if np.issubdtype(a.dtype, np.floating) and a.dtype != np.float32 else a
            for name, a in outputs.items()}


def time_runner(runner: Runner, feed: dict[str, np.ndarray], settings: BenchSettings) -> Timing:
    """Warm ``runner`` (active) up, then time upload + execute + download (end to end) and execute alone (device).

    On CUDA the execute is bracketed by CUDA events on the runner's stream; on the CPU by ``perf_counter_ns``.
    The first run's outputs are returned for the accuracy check.
    """
    cuda = runner.device == "cuda"
    stream = getattr(runner, "stream", None)
    if cuda:
        import torch
    cap = settings.max_seconds
    start = time.perf_counter()
    runner.upload(feed)
    runner.execute()
    outputs = as_float32(runner.download())  # for the accuracy check; the timed runs leave their outputs as they are
    warmup_runs = 1
    while warmup_runs < settings.warmup or time.perf_counter() - start < settings.warmup_seconds:
        if cap is not None and time.perf_counter() - start >= cap:
            break
        runner.upload(feed)
        runner.execute()
        runner.download()
        warmup_runs += 1
    events: list[tuple[Any, Any]] = []
    device_ns: list[int] = []
    e2e_ns: list[int] = []
    begin = time.perf_counter()
    stopped_early = False
    while True:
        t0 = time.perf_counter_ns()
        runner.upload(feed)
        if cuda:
            first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            first.record(stream)
            runner.execute()
            last.record(stream)
            events.append((first, last))
        else:
            l0 = time.perf_counter_ns()
            runner.execute()
            device_ns.append(time.perf_counter_ns() - l0)
        runner.download()  # waits for the outputs
        e2e_ns.append(time.perf_counter_ns() - t0)
        elapsed = time.perf_counter() - begin
        if len(e2e_ns) >= settings.iterations and elapsed >= settings.min_seconds:
            break
        if cap is not None and time.perf_counter() - start >= cap:
            stopped_early = len(e2e_ns) < settings.iterations or elapsed < settings.min_seconds
            break
    if cuda:
        torch.cuda.synchronize()
        device_ms = [float(a.elapsed_time(b)) for a, b in events]
    else:
        device_ms = [ns / 1e6 for ns in device_ns]
    return Timing(device_ms, [ns / 1e6 for ns in e2e_ns], "cuda_event" if cuda else "perf_counter_ns",
                  time.perf_counter() - begin, warmup_runs, stopped_early, outputs)
