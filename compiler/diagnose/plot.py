"""``trtc diff``'s files: ``diff.json`` (the whole comparison) and ``diff.png`` (the relative error of every layer
through the depth of the network, isolated and accumulated; needs matplotlib, the ``trtc[plot]`` extra)."""

from __future__ import annotations

import io
import logging
from pathlib import Path
from typing import Any

from compiler.core.files import atomic_write_bytes, atomic_write_json
from compiler.diagnose.diff import DiffReport

__all__ = ["write_diff_report", "JSON_NAME", "PNG_NAME", "NO_MATPLOTLIB"]

log = logging.getLogger(__name__)

JSON_NAME, PNG_NAME = "diff.json", "diff.png"
NO_MATPLOTLIB = "matplotlib is not installed: no diff.png (pip install 'trtc[plot]')"


def _png_bytes(report: DiffReport) -> bytes | None:
    """The error-through-depth plot as PNG bytes; None without matplotlib. Object API only: no global backend."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        return None
    layers = report.layers
    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    depth = [row.layer.depth for row in layers]
    floor = 1e-7  # a log axis shows an exact zero at the floor

    def values(kind: str) -> list[float]:
        found = [getattr(row, kind) for row in layers]
        return [max(floor, e.relative) if e is not None else float("nan") for e in found]

    ax.plot(depth, values("accumulated"), marker=".", label="accumulated (the graph up to the layer)")
    ax.plot(depth, values("isolated"), marker="x", linestyle="none", label="isolated (the layer alone)")
    if report.jump is not None:
        jump = next(row for row in layers if row.layer.name == report.jump)
        ax.axvline(jump.layer.depth, color="red", linestyle=":", label=f"jump: {jump.layer.name}")
    ax.set_yscale("log")
    ax.set_xlabel("layer (graph order)")
    ax.set_ylabel("relative error ||y - y_ref|| / ||y_ref||")
    ax.set_title(f"{report.candidate['precision']} vs {report.reference['precision']}: "
                 f"{report.candidate['directory']}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    return buffer.getvalue()


def write_diff_report(report: DiffReport, report_dir: Path, sort: str = "isolated", plot: bool = True,
                      ) -> dict[str, Any]:
    """Write ``diff.png`` (unless ``plot`` is False or matplotlib is missing: the returned ``note`` says which) and
    ``diff.json`` into ``report_dir``, each atomically. Returns ``{"json": path, "png": path or None, "note": ...}``."""
    report_dir.mkdir(parents=True, exist_ok=True)
    png = _png_bytes(report) if plot else None
    note = None if png is not None else ("--no-plot" if not plot else NO_MATPLOTLIB)
    if png is not None:
        atomic_write_bytes(report_dir / PNG_NAME, png)
    elif plot:
        log.info(NO_MATPLOTLIB)
    data = report.to_json(sort)
    data["plot"] = {"file": str(report_dir / PNG_NAME) if png is not None else None, "note": note}
    atomic_write_json(report_dir / JSON_NAME, data)
    return {"json": report_dir / JSON_NAME, "png": report_dir / PNG_NAME if png is not None else None, "note": note}
