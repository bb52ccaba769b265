"""What a bench run reports, and writing it.

``BenchResult`` (one backend at one bucket), ``Skipped`` (one that did not run, and why) and the
regressions against a baseline make up ``report_dict``, written to ``bench.json`` (everything),
``bench.csv`` (one row per backend and bucket, skipped ones included) and ``bench.png`` (latency and
throughput against batch size; needs matplotlib, the ``trtc[plot]`` extra) in the report directory.
"""

from __future__ import annotations

import contextlib
import csv
import io
import logging
import os
import platform
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from compiler.bench.accuracy import Accuracy
from compiler.bench.inputs import feed_record
from compiler.bench.timing import Latency
from compiler.core.errors import TrtcError
from compiler.core.files import atomic_write_bytes, atomic_write_json, atomic_write_text
from compiler.core.manifest import Manifest, now, tool_versions
from compiler.core.settings import BenchSettings

__all__ = ["CSV_NAME", "JSON_NAME", "PNG_NAME", "REFERENCE", "REPORT_KIND", "BenchReport", "BenchResult",
           "PerformanceRegression", "Regression", "Skipped", "machine_info", "report_dict", "write_report"]

log = logging.getLogger(__name__)

REPORT_KIND = "trtc-bench"
REPORT_SCHEMA = 1
JSON_NAME, CSV_NAME, PNG_NAME = "bench.json", "bench.csv", "bench.png"
REFERENCE = ("torch", "fp32")  # the row speed-ups are relative to


class PerformanceRegression(TrtcError):
    """``trtc bench --baseline``: a backend got slower than the baseline allows."""

    exit_code = 1


@dataclass(frozen=True)
class BenchResult:
    """One backend at one bucket."""

    backend: str
    precision: str
    bucket: int
    runner: str  # the runner's name: provider, autocast, engine profile
    device: str
    clock: str
    iterations: int
    seconds: float
    stopped_early: bool
    latency_ms: Latency  # device latency
    e2e_ms: Latency  # end to end, host<->device copies included
    throughput: float  # samples/s from the P50 device latency: batch * 1000 / P50, the statistic of every column
    e2e_throughput: float  # samples/s from the P50 end-to-end latency
    spread: float
    cv: float
    spread_wide: bool
    peak_memory_bytes: int | None
    memory_method: str | None
    accuracy: Accuracy | None
    dims: dict[str, int] = field(default_factory=dict)  # the non-batch dynamic dimensions' values
    speedup: float | None = None  # eager PyTorch FP32 P50 / this P50 (device latency), same bucket
    e2e_speedup: float | None = None
    # why the row's times are no speed figure (ONNX Runtime emulates the precision: measure.emulated): an accuracy row
    accuracy_only: str = ""

    @property
    def name(self) -> str:
        return f"{self.backend}/{self.precision}" + (" (accuracy row)" if self.accuracy_only else "")

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["name"] = self.name
        return out


@dataclass(frozen=True)
class Skipped:
    """A backend (and precision, bucket where it applies) that did not run, and why."""

    backend: str
    precision: str | None
    bucket: int | None
    reason: str
    failed: bool = False  # True: it was tried and raised; False: it cannot run here

    @property
    def name(self) -> str:
        return self.backend + (f"/{self.precision}" if self.precision else "")


@dataclass(frozen=True)
class Regression:
    """A row slower than the baseline allows: the metric, its value before and now, and the change."""

    name: str
    bucket: int
    metric: str  # "p50_ms" or "throughput"
    baseline: float
    current: float
    change: float  # fraction, positive = worse

    def describe(self) -> str:
        if self.metric == "p50_ms":
            what = f"P50 {self.baseline:.3f} -> {self.current:.3f} ms"
        else:
            what = f"throughput {self.baseline:,.0f} -> {self.current:,.0f} samples/s"
        return f"{self.name} bucket {self.bucket}: {what} ({100 * self.change:+.1f}% worse)"


@dataclass
class BenchReport:
    """The report as written to bench.json (``data``), where it was written, and the regressions found."""

    data: dict[str, Any]
    json_path: Path
    csv_path: Path
    png_path: Path | None
    regressions: list[Regression] = field(default_factory=list)

    def raise_for_regressions(self) -> None:
        """Raise ``PerformanceRegression`` (exit code 1) when the baseline comparison found any."""
        if not self.regressions:
            return
        threshold = self.data["baseline"]["max_regression"]
        shown = "; ".join(r.describe() for r in self.regressions[:4])
        more = f"; and {len(self.regressions) - 4} more" if len(self.regressions) > 4 else ""
        raise PerformanceRegression(f"performance regression beyond {100 * threshold:g}% against "
                                    f"{self.data['baseline']['file']}: {shown}{more}")


def machine_info() -> dict[str, Any]:
    """The host, CPU and GPU the numbers were measured on."""
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info: dict[str, Any] = {"hostname": socket.gethostname(), "platform": platform.platform(), "cpu": cpu,
                            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                            "cuda": torch.version.cuda, "gpu": None, "gpu_memory_bytes": None,
                            "compute_capability": None, "gpu_count": 0}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, gpu_memory_bytes=int(props.total_memory),
                    compute_capability=f"{props.major}.{props.minor}", gpu_count=torch.cuda.device_count(),
                    cudnn=torch.backends.cudnn.version())
    return info


def _versions() -> dict[str, Any]:
    from compiler.core.capabilities import tensorrt_version

    return {**tool_versions(), "tensorrt": tensorrt_version()}


def report_dict(directory: Path | None, manifest: Manifest, settings: BenchSettings, device: str,
                reference: str, feeds: dict[int, dict[str, np.ndarray]], results: list[BenchResult],
                skipped: list[Skipped], warnings: list[str]) -> dict[str, Any]:
    """bench.json. Keys:

    ``kind`` ("trtc-bench"), ``schema`` (1), ``created``; ``build``: the directory (None for a temporary
    export), source {path, format, sha256}, precision, sha256 of each ONNX and engine; ``machine``;
    ``versions``; ``settings`` (``BenchSettings``); ``device`` of the torch backends; ``reference``;
    ``inputs``: source and, per bucket, the feed's sha256 and tensor shapes/dtypes; ``results``: one
    ``BenchResult`` per backend and bucket (``latency_ms`` and ``e2e_ms`` hold p50, p90, p99, mean, std,
    min, max); ``skipped``: backend, precision, bucket, reason, failed; ``warnings``; ``baseline`` (with
    ``--baseline``: file, max_regression, compared, not_compared, regressions).
    """
    return {
        "kind": REPORT_KIND,
        "schema": REPORT_SCHEMA,
        "created": now(),
        "build": {
            "directory": str(directory) if directory is not None else None,
            "source": manifest.source.to_json() if manifest.source is not None else {},
            "precision": manifest.precision,
            "onnx": {precision: record.sha256 for precision, record in manifest.onnx.items()},
            "engines": {str(e.bucket): e.sha256 for e in manifest.engines},
        },
        "machine": machine_info(),
        "versions": _versions(),
        "settings": settings.to_dict(),
        "device": device,
        "reference": reference,
        "inputs": {"source": str(settings.data) if settings.data else f"random, seed {settings.seed}",
                   "buckets": {str(b): feed_record(feed) for b, feed in feeds.items()}},
        "results": [r.to_dict() for r in results],
        "skipped": [asdict(s) for s in skipped],
        "warnings": warnings,
        "baseline": None,
    }


CSV_FIELDS = ["status", "backend", "precision", "bucket", "dims", "runner", "device", "clock", "iterations",
              "p50_ms", "p90_ms", "p99_ms", "mean_ms", "std_ms", "e2e_p50_ms", "e2e_p90_ms", "e2e_p99_ms",
              "e2e_mean_ms", "throughput", "e2e_throughput", "spread", "cv", "speedup", "e2e_speedup",
              "peak_memory_bytes", "max_abs", "max_rel", "cosine", "top1_agreement", "data", "reason"]


def _csv_text(data: dict[str, Any]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in data["results"]:
        lat, e2e, acc = r["latency_ms"], r["e2e_ms"], r["accuracy"] or {}
        writer.writerow({
            "status": "ok", "backend": r["backend"], "precision": r["precision"], "bucket": r["bucket"],
            "dims": " ".join(f"{k}={v}" for k, v in (r.get("dims") or {}).items()),
            "runner": r["runner"], "device": r["device"], "clock": r["clock"], "iterations": r["iterations"],
            **{f"{k}_ms": lat[k] for k in ("p50", "p90", "p99", "mean", "std")},
            **{f"e2e_{k}_ms": e2e[k] for k in ("p50", "p90", "p99", "mean")},
            "throughput": r["throughput"], "e2e_throughput": r["e2e_throughput"], "spread": r["spread"],
            "cv": r["cv"], "speedup": r["speedup"], "e2e_speedup": r["e2e_speedup"],
            "peak_memory_bytes": r["peak_memory_bytes"], "max_abs": acc.get("max_abs"),
            "max_rel": acc.get("max_rel"), "cosine": acc.get("cosine"), "top1_agreement": acc.get("top1_agreement"),
            "data": acc.get("data"),
            "reason": "",
        })
    for s in data["skipped"]:
        writer.writerow({"status": "failed" if s["failed"] else "skipped", "backend": s["backend"],
                         "precision": s["precision"] or "", "bucket": s["bucket"] if s["bucket"] is not None else "",
                         "reason": s["reason"]})
    return out.getvalue()


def _png_bytes(data: dict[str, Any]) -> bytes | None:
    """Latency (P50, log scale) and throughput against batch size, a line per backend/precision; None without
    matplotlib. Uses matplotlib's object API (no pyplot), so no global backend is changed."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    series: dict[str, list[dict[str, Any]]] = {}
    for r in data["results"]:
        series.setdefault(f"{r['name']} ({r['device']})", []).append(r)
    fig = Figure(figsize=(12, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    lat_ax, tp_ax = fig.subplots(1, 2)
    for label, rows in series.items():
        rows = sorted(rows, key=lambda r: r["bucket"])
        xs = [r["bucket"] for r in rows]
        lat_ax.plot(xs, [r["latency_ms"]["p50"] for r in rows], marker="o", label=label)
        tp_ax.plot(xs, [r["throughput"] for r in rows], marker="o", label=label)
    buckets = sorted({r["bucket"] for r in data["results"]})
    for ax, title, unit in ((lat_ax, "P50 latency", "ms"), (tp_ax, "throughput", "samples/s")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(buckets or [1])
        ax.set_xticklabels([str(b) for b in buckets] or ["1"])
        ax.set_xlabel("batch size")
        ax.set_ylabel(unit)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    if series:
        tp_ax.legend(fontsize="small")
    machine = data["machine"]
    where = machine.get("gpu") or machine.get("cpu")
    fig.suptitle(f"trtc bench: {data['build']['source'].get('path', '?')} on {where}", fontsize="medium")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    return buf.getvalue()


def write_report(data: dict[str, Any], report_dir: Path, plot: bool, regressions: list[Regression]) -> BenchReport:
    """Write bench.png (unless ``plot`` is False or matplotlib is missing; ``data["plot"]`` says which), bench.csv
    and bench.json into ``report_dir``, each atomically, and return the ``BenchReport``."""
    report_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path, png_path = report_dir / JSON_NAME, report_dir / CSV_NAME, report_dir / PNG_NAME
    png = _png_bytes(data) if plot else None
    if png is not None:
        atomic_write_bytes(png_path, png)
        data["plot"] = {"file": str(png_path), "note": None}
    else:
        note = "--no-plot" if not plot else "matplotlib is not installed: install trtc[plot] for bench.png"
        data["plot"] = {"file": None, "note": note}
        if plot:
            log.info("no %s: %s", PNG_NAME, note)
    atomic_write_text(csv_path, _csv_text(data))
    atomic_write_json(json_path, data)
    return BenchReport(data, json_path, csv_path, png_path if png is not None else None, regressions)
