"""Readable summaries of what a command did (rich tables on stdout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["print_export_summary", "console"]

console = Console()


def print_export_summary(manifest: dict[str, Any], out: Path) -> None:
    export = manifest["export"]
    console.print(f"exported {manifest['source']['path']} with the {export['exporter']} exporter "
                  f"(opset {export['opset']}, {export['seconds']:.1f} s)")
    table = Table("pass", "nodes", "initializers", "seconds", "changes", title="graph passes")
    for p in manifest["passes"]:
        counts = {k: len(v) if isinstance(v, list) else v for k, v in p["changes"].items()}
        changes = ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "-"
        table.add_row(p["name"], f"{p['nodes_before']} -> {p['nodes_after']}",
                      f"{p['initializers_before']} -> {p['initializers_after']}", f"{p['seconds']:.3f}", changes)
    console.print(table)
    ver = manifest["verification"]
    table = Table("check", "batch", "max abs", "max rel", "cosine", title=f"verification (rtol {ver['rtol']:g})")
    for key in ("export", "passes"):
        for c in ver.get(key, []):
            table.add_row(key, str(c["batch"]), f"{c['max_abs']:.2e}", f"{c['max_rel']:.2e}", f"{c['cosine']:.6f}")
    console.print(table)
    console.print(f"wrote {out / manifest['onnx']['fp32']['file']} and {out / 'manifest.json'}")
