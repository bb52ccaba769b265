"""Constant folding: onnx-graphsurgeon's ``fold_constants`` (ONNX Runtime evaluates what is constant), exported back
to ONNX with the weights copied once."""

from __future__ import annotations

import gc
from typing import Any

import onnx

from compiler.core.onnx_io import MAX_IR_VERSION

__all__ = ["fold_constants"]


def fold_constants(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Evaluate subgraphs whose inputs are all constant (onnx-graphsurgeon, ONNX Runtime underneath)."""
    import onnx_graphsurgeon as gs

    graph = gs.import_onnx(model)
    before = len(graph.nodes)
    graph.fold_constants(error_ok=True, flatten_subgraphs=False).cleanup()
    folded = _export(graph, model)
    # the graph is a reference cycle (nodes <-> tensors) whose constants hold ``model``'s weights: collected now,
    # not whenever the collector next runs (an idle process waiting on its calibration worker held them all along)
    del graph
    gc.collect()
    return folded, {"nodes_folded": before - len(folded.graph.node)}


def _export(graph: Any, like: onnx.ModelProto) -> onnx.ModelProto:
    """``graph`` as a model like ``like`` (IR version, opsets, producer), its weights copied once.

    onnx-graphsurgeon's exporter copies each weight it did not touch twice (``make_graph`` into the graph,
    ``make_model`` the graph into the model): with the input model that held three copies at once. Here those
    weights are left out of the export (a tensor with their type and shape stands in) and copied into the
    exported model one at a time: the same model, with one copy less.
    """
    import onnx_graphsurgeon as gs
    from onnx_graphsurgeon.ir.tensor import LazyValues

    untouched: dict[str, onnx.TensorProto] = {}
    for tensor in graph.tensors().values():
        values = getattr(tensor, "_values", None)  # gs keeps an unloaded initializer as LazyValues(proto)
        if isinstance(tensor, gs.Constant) and isinstance(values, LazyValues) and values.tensor.ByteSize() > 1024:
            untouched[tensor.name] = values.tensor
            tensor._values = LazyValues(onnx.TensorProto(name=tensor.name, data_type=values.tensor.data_type,
                                                         dims=values.tensor.dims))
    out = gs.export_onnx(graph)
    for init in out.graph.initializer:
        if init.name in untouched:
            name = init.name  # gs's name for the tensor, which it exports under
            init.CopyFrom(untouched[name])
            init.name = name
    out.ir_version = min(like.ir_version or MAX_IR_VERSION, MAX_IR_VERSION)
    del out.opset_import[:]
    out.opset_import.extend(like.opset_import)
    out.producer_name, out.producer_version = like.producer_name, like.producer_version
    return out
