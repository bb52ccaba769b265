"""``trtc inspect``: the facts of a build directory, from its manifest, its reports, its graphs and its engines.

``inspect_directory(DIR)`` gathers them into one JSON-able dict: the source model and its export (exporter,
fallback and why), the inputs and outputs with their dims and dynamic ranges, the buckets and each engine's
profile, every precision graph with its node counts by precision and the layers kept out of the reduced precision
(and why), the accuracy gate's result and the data behind it, and each engine (TensorRT version, GPU,
compatibility, size, build time, whether it runs here as ``trtc check`` decides, its layers by precision where a
layer report exists). ``layer_rows`` lists every node of every graph with its precision. Nothing is run; the
graphs are read without their weights, and only after their sha256 matches the manifest's.
"""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

from compiler.backends.tensorrt.layers import layer_io_types
from compiler.backends.tensorrt.profiles import engine_profile_shapes
from compiler.core.errors import InputError
from compiler.core.files import inside, read_json
from compiler.core.manifest import Manifest, read_manifest
from compiler.core.onnx_io import load_onnx
from compiler.core.specs import BATCH_DIM
from compiler.diagnose.diff import kept_layers
from compiler.diagnose.graphs import layer_precisions

__all__ = ["inspect_directory", "layer_rows", "PRECISION_ORDER"]

log = logging.getLogger(__name__)

PRECISION_ORDER = ("int4", "fp8", "int8", "fp16", "bf16", "fp32")


def _reports(directory: Path) -> dict[str, Any]:
    path = directory / "report" / "accuracy.json"
    try:
        found = read_json(path) if path.is_file() else {}
    except (OSError, ValueError):
        log.warning("%s does not read: the gate's records are not shown", path)
        return {}
    return found if isinstance(found, dict) else {}


def _graph_precisions(directory: Path, manifest: Manifest) -> dict[str, dict[str, str]]:
    """Per precision graph, each layer's precision as the graph holds it (``graphs.layer_precisions``)."""
    found = {}
    for precision in manifest.onnx:
        path = manifest.onnx_for(directory, precision)
        found[precision] = layer_precisions(load_onnx(path, load_weights=False))
    return found


def _inputs(manifest: Manifest) -> list[dict[str, Any]]:
    spec = manifest.spec
    buckets = manifest.build.buckets if manifest.build is not None else manifest.buckets
    rows = []
    for item in spec.inputs:
        ranges = {}
        for axis, dim in enumerate(item.dims):
            if dim == BATCH_DIM:
                ranges[str(axis)] = f"B 1..{max(buckets)}" if buckets else "B"
            elif isinstance(dim, str):
                ranges[str(axis)] = f"{dim} {spec.dims[dim]}" if dim in spec.dims else dim
        rows.append({"name": item.name, "dims": "x".join(str(d) for d in item.dims), "dtype": item.dtype,
                     "dynamic": ranges})
    return rows


def _outputs(directory: Path, manifest: Manifest) -> list[dict[str, Any]]:
    graph = load_onnx(manifest.onnx_for(directory, "fp32"), load_weights=False).graph if "fp32" in manifest.onnx \
        else None
    if graph is None:
        return [{"name": name, "dims": "?", "dtype": "?"} for name in manifest.output_names]
    import onnx

    rows = []
    for out in graph.output:
        kind = out.type.tensor_type
        dims = "x".join(d.dim_param or str(d.dim_value) if (d.dim_param or d.HasField("dim_value")) else "?"
                        for d in kind.shape.dim)
        rows.append({"name": out.name, "dims": dims,
                     "dtype": onnx.helper.tensor_dtype_to_np_dtype(kind.elem_type).name if kind.elem_type else "?"})
    return rows


def _profiles(manifest: Manifest) -> list[dict[str, Any]]:
    """Each engine's optimization profile as recorded, else the profiles a build of these buckets would use."""
    def shapes(ranges: dict[str, Any]) -> dict[str, str]:
        return {name: " / ".join("x".join(str(v) for v in s) for s in r) for name, r in ranges.items()}

    if manifest.engines:
        return [{"bucket": e.bucket, "profile": e.profile,
                 "shapes": shapes({n: (s.min, s.opt, s.max) for n, s in e.shapes.items()})} for e in manifest.engines]
    settings = manifest.rebuild_settings()
    planned = engine_profile_shapes(manifest.spec, settings.buckets, settings.multi_profile)
    return [{"bucket": b, "profile": k if settings.multi_profile else 0, "shapes": shapes(dict(p)), "planned": True}
            for k, (b, p) in enumerate(zip(sorted(settings.buckets), planned))]


def _precision_rows(directory: Path, manifest: Manifest, graphs: dict[str, dict[str, str]],
                    reports: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for precision, record in manifest.onnx.items():
        counts = Counter(graphs[precision].values())
        rows.append({"precision": precision, "file": record.file, "bytes": record.bytes,
                     "nodes": {p: counts[p] for p in PRECISION_ORDER if counts[p]},
                     "kept": kept_layers(directory, precision) if precision in reports else {}})
    return rows


def _gate(reports: dict[str, Any]) -> dict[str, Any]:
    gate = {}
    for precision, report in reports.items():
        if not isinstance(report, dict) or not isinstance(report.get("accuracy"), dict):
            continue
        acc = report["accuracy"]
        history = report.get("gate_history") or []
        gate[precision] = {
            "metric": acc.get("metric"), "passed": acc.get("passed"), "fp32_top1": acc.get("fp32_top1"),
            "top1": acc.get("top1"), "drop_points": acc.get("drop_points"), "cosine_mean": acc.get("cosine_mean"),
            "cosine_min": acc.get("cosine_min"), "max_abs": acc.get("max_abs"), "worst_output": acc.get("worst_output"),
            "provider": acc.get("provider"), "settings": report.get("gate"),
            "eval_data": report.get("eval_data"), "calibration_data": report.get("calibration_data"),
            "calibration": report.get("calibration"), "fallback_steps": max(0, len(history) - 1),
            "ranking_seconds": report.get("ranking_seconds"), "warnings": acc.get("warnings") or []}
    return gate


def _layer_file_summary(directory: Path, layers: Any) -> dict[str, Any] | None:
    """Per-layer precisions of an engine's layer report: layers by the type they read (INT8, FP8, FP16, else
    FP32), as TensorRT's inspector gives them; None where the engine has no layer file."""
    name = (layers or {}).get("file") if isinstance(layers, dict) else None
    if not name:
        return None
    path = inside(directory, name, "layer file")
    if not path.is_file():
        return {"file": name, "missing": True}
    try:
        info = read_json(path)
    except (OSError, ValueError):
        return {"file": name, "unreadable": True}
    entries = info.get("Layers", []) if isinstance(info, dict) else []
    counts: Counter[str] = Counter()
    for layer in entries:
        reads = layer_io_types(layer)[0] if isinstance(layer, dict) else []
        counts[next((t for t in ("INT4", "FP8", "INT8", "FP16", "BF16") if t in reads), "FP32")] += 1
    return {"file": name, "count": len(entries), "by_precision": dict(counts)}


def _engines(directory: Path, manifest: Manifest) -> list[dict[str, Any]]:
    if not manifest.engines:
        return []
    from compiler.pipeline.check import check_directory

    result = check_directory(directory)
    stale = {(s.bucket, s.file): s.reason for s in result.stale}
    overall = next((s.reason for s in result.stale if s.bucket is None), None)
    env = manifest.environment or {}
    rows = []
    for engine in manifest.engines:
        why = stale.get((engine.bucket, engine.file)) or overall
        rows.append({"bucket": engine.bucket, "file": engine.file, "bytes": engine.bytes,
                     "precision": manifest.engine_precision(engine), "build_seconds": engine.build_seconds,
                     "tensorrt": env.get("tensorrt"), "gpu": env.get("gpu"),
                     "compute_capability": env.get("compute_capability"), "hardware_compat": manifest.hardware_compat,
                     "version_compatible": manifest.version_compatible, "runs_here": why is None, "why_not": why,
                     "layers": _layer_file_summary(directory, engine.layers)})
    return rows


def inspect_directory(directory: Path) -> dict[str, Any]:
    """The facts of build directory ``directory`` (module docstring), as one JSON-able dict. InputError for a
    directory without a readable manifest or with a graph that does not match it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise InputError(f"{directory}: no such directory; give a build directory (`trtc build --out DIR`)")
    manifest = read_manifest(directory)
    reports = _reports(directory)
    graphs = _graph_precisions(directory, manifest)
    source = manifest.source
    export = manifest.export or {}
    return {
        "directory": str(directory), "trtc_version": manifest.trtc_version, "created": manifest.created,
        "source": {"path": source.path if source else None, "format": source.format if source else None,
                   "sha256": source.sha256 if source else None,
                   "snapshot": source.snapshot.file if source and source.snapshot else None},
        "export": {"exporter": export.get("exporter"), "opset": export.get("opset"),
                   "fallback_reason": export.get("fallback_reason"), "seconds": export.get("seconds")},
        "inputs": _inputs(manifest), "outputs": _outputs(directory, manifest),
        "buckets": list(manifest.build.buckets if manifest.build is not None else manifest.buckets),
        "profiles": _profiles(manifest), "precision": manifest.precision,
        "graphs": _precision_rows(directory, manifest, graphs, reports), "gate": _gate(reports),
        "calibration": dict(manifest.calibration) if manifest.calibration else None,
        "engines": _engines(directory, manifest), "engines_note": manifest.engines_note,
    }


def layer_rows(directory: Path) -> list[dict[str, Any]]:
    """Every layer of the directory's graphs in the FP32 graph's order: its precision in each graph and, where a
    reduced graph kept it out of its precision, why."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    graphs = _graph_precisions(directory, manifest)
    kept = {p: kept_layers(directory, p) for p in manifest.onnx if p != "fp32"}
    order = dict.fromkeys(graphs.get("fp32") or next(iter(graphs.values()), {}))
    order.update(dict.fromkeys(n for g in graphs.values() for n in g))
    rows = []
    for name in order:
        why = next((kept[p][name] for p in kept if name in kept[p]), None)
        rows.append({"layer": name, "precisions": {p: g.get(name) for p, g in graphs.items()}, "kept": why})
    return rows
