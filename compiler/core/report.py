"""Readable summaries of what a command did (rich tables on stdout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from compiler.core.manifest import MANIFEST, Manifest, read_manifest

__all__ = ["print_export_summary", "console", "print_stage_times"]

console = Console()


def print_export_summary(manifest: Manifest, out: Path) -> None:
    export = manifest.export or {}
    source = manifest.source.path if manifest.source is not None else "?"
    console.print(f"exported {source} with the {export['exporter']} exporter "
                  f"(opset {export['opset']}, {export['seconds']:.1f} s)")
    table = Table("pass", "nodes", "initializers", "seconds", "changes", title="graph passes")
    for p in manifest.passes or ():
        counts = {k: len(v) if isinstance(v, list) else v for k, v in p["changes"].items()}
        changes = ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "-"
        table.add_row(p["name"], f"{p['nodes_before']} -> {p['nodes_after']}",
                      f"{p['initializers_before']} -> {p['initializers_after']}", f"{p['seconds']:.3f}", changes)
    console.print(table)
    ver = manifest.verification or {}
    title = f"verification (atol {ver.get('atol', 0):g}, rtol {ver['rtol']:g}; inputs: {ver.get('inputs', 'random')})"
    table = Table("check", "batch", "max abs", "max rel", "cosine", "outside", title=title)
    for key in ("export", "passes"):
        for c in ver.get(key, []):
            table.add_row(key, str(c["batch"]), f"{c['max_abs']:.2e}", f"{c['max_rel']:.2e}", f"{c['cosine']:.6f}",
                          f"{c.get('mismatched', 0)}/{c.get('elements', 0)}")
    console.print(table)
    console.print(f"wrote {out / manifest.onnx['fp32'].file} and {out / MANIFEST}")


def print_accuracy(directory: Path) -> None:
    """The accuracy table from DIR/report/accuracy.json."""
    import json

    path = directory / "report" / "accuracy.json"
    if not path.is_file():
        return
    for precision, report in json.loads(path.read_text()).items():
        _print_accuracy_entry(precision, report, path)


def _print_accuracy_entry(precision: str, report: dict[str, Any], path: Path) -> None:
    acc = report.get("accuracy")
    if acc is None:
        console.print(f"{report['precision']}: {report.get('note')}")
        return
    kept_as = str(report.get("kept_as") or "fp32").upper()  # INT8, FP8, INT4 keep their layers in FP16
    table = Table("precision", "metric", "FP32", "reduced", "drop / cosine", "max abs err", f"kept in {kept_as}",
                  title="accuracy vs FP32 (ONNX Runtime)")
    if acc["metric"] == "top1":
        cols = [f"{100 * acc['fp32_top1']:.2f}%", f"{100 * acc['top1']:.2f}%", f"{acc['drop_points']:.2f} pts"]
    else:
        cosine = acc["cosine_mean"]  # None where every FP32 output was all zero
        worst = f" ({acc['worst_output']})" if acc.get("worst_output") and len(acc.get("per_output") or {}) > 1 else ""
        cols = ["-", "-", ("n/a" if cosine is None else f"{cosine:.5f}") + worst]
    kept = report.get("kept_in_fp32") or {}
    table.add_row(report["precision"], acc["metric"], *cols, f"{acc['max_abs']:.3g}", str(len(kept)))
    console.print(table)
    for layer, why in kept.items():
        console.print(f"  {layer}: {why}")
    for warning in acc.get("warnings") or []:
        console.print(f"  warning: {warning}")
    data = report.get("calibration_data") or {}
    if data.get("random"):
        console.print("[bold red]calibrated on RANDOM data: for smoke tests only[/]")
    console.print("PASS" if acc["passed"] else "FAIL", f"({path})")


def print_build_summary(out: Path, manifest: Manifest | None = None) -> None:
    """The accuracy table and the artifacts of a build: ``manifest``, else the one in ``out`` (none: nothing)."""
    if manifest is None:
        if not (out / MANIFEST).is_file():
            return
        manifest = read_manifest(out)
    print_accuracy(out)
    table = Table("artifact", "file", "size", title=f"build {out} ({manifest.precision})")
    for precision, record in manifest.onnx.items():
        table.add_row(f"onnx {precision}", record.file, f"{(record.bytes or 0) / 2**20:.2f} MiB")
    for engine in manifest.engines:
        table.add_row(f"engine b{engine.bucket}", engine.file, f"{(engine.bytes or 0) / 2**20:.2f} MiB")
    console.print(table)
    if manifest.engines_note:
        console.print(f"engines: not built ({manifest.engines_note.removeprefix('not built: ')})")


def print_stage_times(times: Any) -> None:
    """The table of a command's stages (a ``compiler.core.progress.StageTimes``): each stage's seconds, then what no
    stage holds and the process's seconds so far; the same record as the directory's report/timing.json."""
    record = times.to_dict()
    table = Table("stage", "seconds", title="time")
    for name, seconds in record["stages"].items():
        table.add_row(name, f"{seconds:.2f}")
    table.add_row("(outside every stage)", f"{record['unaccounted_seconds']:.2f}")
    table.add_row("total", f"{record['process_seconds']:.2f}")
    console.print(table)
