"""The terminal view of a bench report: the results table, then skipped backends, warnings, files and baseline."""

from __future__ import annotations

from typing import Any

from compiler.bench.report import PNG_NAME, REFERENCE, BenchReport

__all__ = ["bench_renderables", "short_runner"]

SAMPLES, SPEEDUP = "samples/s\n(P50)", "speed-up\n(P50)"  # the statistic each is computed from, in its header
ACCURACY_MARK = " *"  # after the backend of an accuracy row (the caption says what it is)


def bench_renderables(report: BenchReport, wide: bool | None = None) -> list[Any]:
    """Rich renderables for the terminal: the results table, then skipped backends, warnings, files, baseline.

    The table fits 120 columns: backend, batch (with every dynamic dimension's value), P50, P99, end-to-end P50,
    throughput and speed-up (both from the P50, as their headers say), cosine and, for classifiers, top-1; the
    caption says so, and what an accuracy row is. ``wide`` (default: the report's settings) adds the
    runner, P90, spread, end-to-end speed-up, peak memory and max abs error; bench.json and bench.csv hold all.
    """
    from rich.table import Table
    from rich.text import Text

    data = report.data
    wide = bool(data["settings"].get("wide")) if wide is None else wide
    machine = data["machine"]
    results = data["results"]
    has_reference = any((r["backend"], r["precision"]) == REFERENCE for r in results)
    top1 = any((r["accuracy"] or {}).get("top1_agreement") is not None for r in results)
    tf32 = data.get("tf32") or {}
    speed = "speed-up vs torch/fp32 P50" if has_reference else "no torch/fp32 row: no speed-ups"
    title = (f"trtc bench: {data['build']['source'].get('path', '?')} on {machine.get('gpu') or machine.get('cpu')}"
             f" ({speed}; TF32 {'on' if tf32.get('enabled', True) else 'off'})")
    columns = ["backend", *(["runner"] if wide else []), "batch", "P50 ms", *(["P90 ms"] if wide else []), "P99 ms",
               *(["spread"] if wide else []), "e2e P50 ms", SAMPLES, *([SPEEDUP] if has_reference else []),
               *(["e2e speed-up"] if has_reference and wide else []), *(["peak MiB", "max abs"] if wide else []),
               "cosine", *(["top-1"] if top1 else [])]
    accuracy_rows = any(r.get("accuracy_only") for r in results)
    caption = (f"samples/s and speed-up from the P50 device latency (e2e: end to end, copies included); accuracy vs "
               f"{data['reference']} on {data['inputs']['source']}"
               + (f";{ACCURACY_MARK}: an accuracy row: the provider only emulates that precision, its time is no "
                  "speed figure" if accuracy_rows else ""))
    table = Table(*columns, title=title, caption=caption)
    for r in results:
        acc = r["accuracy"] or {}
        spread = f"{100 * r['spread']:.0f}%"
        dims = " ".join(f"{k}={v}" for k, v in (r.get("dims") or {}).items())
        cells: dict[str, Any] = {
            "backend": f"{r['backend']}/{r['precision']}" + (ACCURACY_MARK if r.get("accuracy_only") else ""),
            "runner": short_runner(r["runner"]),
            "batch": f"{r['bucket']} {dims}".strip(), "P50 ms": f"{r['latency_ms']['p50']:.3f}",
            "P90 ms": f"{r['latency_ms']['p90']:.3f}", "P99 ms": f"{r['latency_ms']['p99']:.3f}",
            "spread": Text(spread + " !", style="bold yellow") if r["spread_wide"] else spread,
            "e2e P50 ms": f"{r['e2e_ms']['p50']:.3f}", SAMPLES: f"{r['throughput']:,.0f}",
            SPEEDUP: _times(r["speedup"]), "e2e speed-up": _times(r["e2e_speedup"]),
            "peak MiB": f"{r['peak_memory_bytes'] / 2**20:.1f}" if r["peak_memory_bytes"] is not None else "-",
            "max abs": f"{acc['max_abs']:.2e}" if acc else "-", "cosine": f"{acc['cosine']:.6f}" if acc else "-",
            "top-1": f"{100 * acc['top1_agreement']:.1f}%" if acc.get("top1_agreement") is not None else "-"}
        table.add_row(*(cells[c] for c in columns))
    out: list[Any] = [table]
    for s in data["skipped"]:
        where = f" bucket {s['bucket']}" if s["bucket"] is not None else ""
        name = s["backend"] + (f"/{s['precision']}" if s["precision"] else "")
        style = "bold red" if s["failed"] else "dim"
        out.append(Text(f"{'failed' if s['failed'] else 'skipped'}: {name}{where}: {s['reason']}", style=style))
    out += [Text(f"warning: {w}", style="yellow") for w in data["warnings"]]
    files = [str(report.json_path), str(report.csv_path)] + ([str(report.png_path)] if report.png_path else [])
    more = "" if wide else " (every column: --wide, or the files)"
    out.append(Text(f"wrote {', '.join(files)}" + (f" (no {PNG_NAME}: {data['plot']['note']})"
                                                  if not report.png_path else "") + more))
    base = data.get("baseline")
    if base:
        verdict = (f"{len(report.regressions)} regression(s)" if report.regressions else "no regression")
        out.append(Text(f"baseline {base['file']}: {base['compared']} row(s) compared, {verdict} beyond "
                        f"{100 * base['max_regression']:g}%", style="bold red" if report.regressions else "green"))
        out += [Text(f"  regressed: {r.describe()}", style="red") for r in report.regressions]
        out += [Text(f"  not compared: {n}", style="dim") for n in base["not_compared"]]
    return out


def short_runner(name: str) -> str:
    """The runner's name without its backend: "onnxruntime[CUDAExecutionProvider]" -> "CUDA EP", "torch" -> "eager"."""
    inside = name.partition("[")[2].rstrip("]")
    if not inside:
        return {"torch": "eager", "torch-cudagraph": "CUDA graph", "tensorrt": "engine"}.get(name, name)
    return inside.replace("ExecutionProvider", " EP")


def _times(value: float | None) -> str:
    return f"{value:.2f}x" if value is not None else "-"
