"""Build directories for the diagnosis tests, and the deliberate break they look for: one activation Q/DQ scale
coarsened in a precision graph, with the manifest's digest updated so that the build still verifies."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import onnx

from compiler.core.manifest import MANIFEST, FileRecord, read_manifest, write_manifest
from compiler.core.onnx_io import load_onnx, save_onnx
from compiler.core.settings import ExportSettings, ModelSource
from compiler.core.specs import ModelSpec, parse_dim_range, parse_input_spec
from compiler.pipeline.export import export_directory

__all__ = ["single_consumer_layers", "coarsen_activation_scale", "export"]


def export(out: Path, factory: str, inputs: list[str], dims: dict[str, str] | None = None,
           weights: Path | None = None) -> Path:
    """An FP32 export of ``factory`` into ``out`` (buckets 1 and 16)."""
    spec = ModelSpec(tuple(parse_input_spec(i) for i in inputs),
                     dict(parse_dim_range(f"{k}={v}") for k, v in (dims or {}).items()))
    export_directory(ExportSettings(ModelSource(factory=factory, weights=weights), out, spec=spec, buckets=(1, 16)))
    return out


def _activation_dq(model: onnx.ModelProto, node: onnx.NodeProto) -> onnx.NodeProto | None:
    """The DequantizeLinear of ``node``'s activation input (the one behind a QuantizeLinear), if any."""
    producers = {o: n for n in model.graph.node for o in n.output}
    for tensor in node.input:
        dq = producers.get(tensor)
        if dq is not None and dq.op_type == "DequantizeLinear" and dq.input[0] in producers \
                and producers[dq.input[0]].op_type == "QuantizeLinear":
            return dq
    return None


def single_consumer_layers(path: Path, op_types: tuple[str, ...]) -> list[str]:
    """The layers of ``op_types`` in graph order whose activation Q/DQ feeds only them: breaking its scale
    breaks that one layer."""
    model = load_onnx(path, load_weights=False)
    readers: dict[str, int] = {}
    for node in model.graph.node:
        for tensor in node.input:
            readers[tensor] = readers.get(tensor, 0) + 1
    found = []
    for node in model.graph.node:
        dq = _activation_dq(model, node) if node.op_type in op_types else None
        if dq is not None and readers.get(dq.output[0]) == 1:
            found.append(node.name)
    return found


def coarsen_activation_scale(directory: Path, layer: str, factor: float = 24.0, precision: str = "int8") -> str:
    """Multiply the scale of ``layer``'s activation Q/DQ by ``factor`` in the ``precision`` graph of ``directory``
    and record the graph's new digest in the manifest. Returns the scale's name."""
    manifest = read_manifest(directory)
    path = manifest.onnx_for(directory, precision)
    model = load_onnx(path)
    node = next(n for n in model.graph.node if n.name == layer)
    dq = _activation_dq(model, node)
    assert dq is not None, f"{layer} has no activation Q/DQ"
    scale = next(t for t in model.graph.initializer if t.name == dq.input[1])
    value = onnx.numpy_helper.to_array(scale) * factor
    scale.CopyFrom(onnx.numpy_helper.from_array(value.astype(value.dtype), scale.name))
    save_onnx(model, path)
    record = FileRecord.for_onnx(directory, path)
    write_manifest(directory / MANIFEST, replace(manifest, onnx={**manifest.onnx, precision: record}))
    return scale.name
