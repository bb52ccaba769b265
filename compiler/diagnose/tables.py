"""What ``trtc inspect`` and ``trtc diff`` print: tables and lines, as rich tables on a terminal and as plain aligned
lines elsewhere (CI logs, pipes), where every row stays one line for grep."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from compiler.diagnose.diff import DiffReport, Errors
from compiler.diagnose.graphs import INTEGER
from compiler.diagnose.inspect import PRECISION_ORDER

__all__ = ["Table", "render", "inspect_tables", "layer_table", "diff_tables"]

_ENGINE_ORDER = ("INT4", "FP8", "INT8", "FP16", "BF16", "FP32")


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # lines printed under the table


def render(items: list[Table | str], console: Any) -> None:
    """Print ``items`` on a rich ``console``: rich tables where it is a terminal, plain columns elsewhere."""
    from rich.table import Table as RichTable

    for item in items:
        if isinstance(item, str):
            console.print(item, markup=False, highlight=False, soft_wrap=True)
            continue
        if console.is_terminal:
            table = RichTable(*item.columns, title=item.title, title_justify="left")
            for row in item.rows:
                table.add_row(*row)
            console.print(table)
        else:
            widths = [max(len(c), *(len(r[i]) for r in item.rows)) if item.rows else len(c)
                      for i, c in enumerate(item.columns)]
            console.print(item.title, markup=False, highlight=False, soft_wrap=True)
            for row in [item.columns, *item.rows]:
                line = "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                console.print("  " + line, markup=False, highlight=False, soft_wrap=True)
        for note in item.notes:
            console.print("  " + note, markup=False, highlight=False, soft_wrap=True)


def _size(value: Any) -> str:
    return f"{value / 2**20:.2f} MiB" if isinstance(value, (int, float)) else "-"


def _counts(nodes: dict[str, int]) -> str:
    return ", ".join(f"{nodes[p]} {p.upper()}" for p in PRECISION_ORDER if nodes.get(p)) or "-"


def inspect_tables(facts: dict[str, Any]) -> list[Table | str]:
    """``trtc inspect``'s screen from ``inspect_directory``'s facts."""
    source, export = facts["source"], facts["export"]
    exporter = export.get("exporter") or "?"
    fallback = f", fell back: {export['fallback_reason']}" if export.get("fallback_reason") else ""
    items: list[Table | str] = [
        f"{facts['directory']}: {source.get('path')} ({source.get('format')}), exported with {exporter} "
        f"(opset {export.get('opset')}{fallback}); last precision {facts['precision']}"]
    io = Table("inputs and outputs", ["", "name", "dims", "dtype", "dynamic ranges"])
    for row in facts["inputs"]:
        ranges = ", ".join(f"axis {a}: {r}" for a, r in row["dynamic"].items()) or "-"
        io.rows.append(["in", row["name"], row["dims"], row["dtype"], ranges])
    for row in facts["outputs"]:
        io.rows.append(["out", row["name"], row["dims"], row["dtype"], "-"])
    items.append(io)
    profiles = Table(f"buckets {','.join(map(str, facts['buckets']))}: engine profiles (min / opt / max)"
                     + (" as a build would make them" if any(p.get("planned") for p in facts["profiles"]) else ""),
                     ["bucket", "profile", "shapes"])
    for p in facts["profiles"]:
        shapes = "; ".join(f"{n} {s}" for n, s in p["shapes"].items())
        profiles.rows.append([str(p["bucket"]), str(p["profile"]), shapes])
    items.append(profiles)
    graphs = Table("graphs", ["precision", "file", "size", "layers by precision", "kept out"])
    for g in facts["graphs"]:
        graphs.rows.append([g["precision"], g["file"], _size(g["bytes"]), _counts(g["nodes"]), str(len(g["kept"]))])
        graphs.notes += [f"{g['precision']}: {layer}: {why}" for layer, why in g["kept"].items()]
    items.append(graphs)
    for precision, gate in facts["gate"].items():
        items.append(_gate_table(precision, gate))
    engines = Table("engines", ["bucket", "file", "size", "built in", "TensorRT", "GPU", "compatibility", "runs here",
                                "layers"])
    for e in facts["engines"]:
        levels = [e["hardware_compat"] if e["hardware_compat"] != "none" else "",
                  "version-compatible" if e["version_compatible"] else ""]
        compat = ", ".join(x for x in levels if x) or "this GPU model"
        layers = e.get("layers") or {}
        by = layers.get("by_precision") or {}
        summary = (", ".join(f"{by[t]} {t}" for t in sorted(by, key=lambda t: _ENGINE_ORDER.index(t)
                                                                if t in _ENGINE_ORDER else len(_ENGINE_ORDER)))
                   if layers.get("by_precision") else ("-" if not layers else "unreadable"))
        built = f"{e['build_seconds']:.1f} s" if isinstance(e["build_seconds"], (int, float)) else "-"
        engines.rows.append([str(e["bucket"]), e["file"], _size(e["bytes"]), built, str(e["tensorrt"] or "?"),
                             f"{e['gpu'] or '?'} ({e['compute_capability'] or '?'})", compat,
                             "yes" if e["runs_here"] else f"no: {e['why_not']}", summary])
    if facts["engines"]:
        items.append(engines)
    else:
        items.append(f"engines: none ({(facts.get('engines_note') or 'never built').removeprefix('not built: ')})")
    return items


def _gate_table(precision: str, gate: dict[str, Any]) -> Table:
    table = Table(f"accuracy gate, {precision}: {'PASS' if gate['passed'] else 'FAIL'}",
                  ["metric", "FP32", precision.upper(), "drop / cosine", "min cosine", "max abs", "eval data",
                   "fallback"])
    cosine = gate.get("cosine_mean")
    if gate["metric"] == "top1":
        values = [f"{100 * gate['fp32_top1']:.2f}%", f"{100 * gate['top1']:.2f}%", f"{gate['drop_points']:.2f} pts"]
    else:
        values = ["-", "-", "n/a" if cosine is None else f"{cosine:.5f}"]
    data = gate.get("eval_data") or {}
    settings = gate.get("settings") or {}
    table.rows.append([gate["metric"] or "?", *values,
                       "-" if gate.get("cosine_min") is None else f"{gate['cosine_min']:.5f}",
                       "-" if gate.get("max_abs") is None else f"{gate['max_abs']:.3g}",
                       f"{data.get('samples', '?')} of {data.get('source', '?')}",
                       f"{gate['fallback_steps']} of {settings.get('max_fallback', '?')} steps"])
    calib = gate.get("calibration") or {}
    cdata = gate.get("calibration_data") or {}
    if calib or cdata:
        method = f"{calib.get('method')}" + (f" {calib['percentile']}" if calib.get("method") == "percentile" else "")
        table.notes.append(f"calibrated: {method} on {cdata.get('samples', '?')} samples of {cdata.get('source', '?')}"
                           + (" (RANDOM: smoke tests only)" if cdata.get("random") else "")
                           + f"; gate: drop <= {settings.get('max_accuracy_drop')} pts with labels, else cosine >= "
                           f"{settings.get('min_cosine')}")
    table.notes += [f"warning: {w}" for w in gate.get("warnings") or []]
    return table


def layer_table(rows: list[dict[str, Any]]) -> Table:
    """``trtc inspect --layers``: every node with its precision in each graph."""
    precisions = list(rows[0]["precisions"]) if rows else []
    table = Table("layers", ["layer", *precisions, "kept out because"])
    for row in rows:
        if all(p in (None, INTEGER) for p in row["precisions"].values()):
            continue
        table.rows.append([row["layer"], *[str(row["precisions"][p] or "-") for p in precisions], row["kept"] or ""])
    table.notes.append(f"{len(rows) - len(table.rows)} integer nodes (shape arithmetic) not listed")
    return table


def _num(value: float | None, digits: int = 3) -> str:
    if value is None:
        return "-"
    if math.isinf(value):
        return "inf"
    return f"{value:.{digits}g}"


def _errors(errors: Errors | None) -> list[str]:
    if errors is None:
        return ["-", "-", "-"]
    cosine = "-" if errors.cosine is None else f"{errors.cosine:.5f}"
    return [cosine, _num(errors.relative), _num(errors.max_abs)]


def diff_tables(report: DiffReport, top: int, sort: str = "isolated") -> list[Table | str]:
    """``trtc diff``'s screen: the ``top`` worst layers by ``sort``, the graph outputs, the jump."""
    ref, cand = report.reference, report.candidate
    same = ref["directory"] == cand["directory"]
    what = (f"{cand['precision']} vs {ref['precision']} of {ref['directory']}" if same else
            f"{cand['directory']} ({cand['precision']}) vs {ref['directory']} ({ref['precision']})")
    items: list[Table | str] = [f"{what}: {report.samples} samples of {report.data}, ONNX Runtime "
                                f"{report.provider.removesuffix('ExecutionProvider')}, {report.seconds:.1f} s"]
    ranked = report.ranked(sort)
    table = Table(f"layers, worst {sort} error first ({min(top, len(ranked))} of {len(ranked)})",
                  ["#", "layer", "op", "prec", "iso cos", "iso rel", "iso max", "acc cos", "acc rel", "acc max",
                   "kept out"])
    for index, row in enumerate(ranked[:top], 1):
        name = row.layer.name + ("  <- jump" if row.jump else "")
        table.rows.append([str(index), name, row.layer.op_type, row.layer.precision, *_errors(row.isolated),
                           *_errors(row.accumulated), row.kept or ""])
    table.notes.append("iso: the layer alone in its precision on the reference's inputs; acc: the whole graph up to "
                       "it; rel = ||y - y_ref|| / ||y_ref||")
    items.append(table)
    if report.jump is not None:
        jump = next(r for r in report.layers if r.layer.name == report.jump)
        items.append(f"accumulated error jumps first at {jump.layer.name} ({jump.layer.op_type}, depth "
                     f"{jump.layer.depth} of {len(report.layers)}): +{_num(jump.rise)} relative over its inputs")
    if report.outputs:
        outputs = Table("outputs", ["output", "cosine", "rel", "max abs"])
        for name, errors in report.outputs.items():
            outputs.rows.append([name, *_errors(errors)])
        items.append(outputs)
    for engine in report.engines or []:
        items.append(f"engine bucket {engine['bucket']} vs FP32 ONNX: " + ", ".join(
            f"{o}: cosine {_num(e['cosine'], 5)}, rel {_num(e['relative'])}, max abs {_num(e['max_abs'])}"
            for o, e in engine["outputs"].items()))
    items += report.notes
    return items
