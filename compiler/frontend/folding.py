"""Constant folding: onnx-graphsurgeon's ``fold_constants`` (ONNX Runtime evaluates what is constant), exported back
to ONNX with the weights copied once, without the rewrites of onnx-graphsurgeon's that change what a graph computes.

What onnx-graphsurgeon 0.6 gets wrong, and what trtc does instead:

* its shape folding (``fold_shapes=True``) replaces a ``Shape`` by its input's whole static shape, ignoring
  Shape-15's ``start``/``end`` (``Shape(x, start=1)`` of a 3x4x5 ``x`` became [3, 4, 5], not [4, 5]), and reads a
  ``Gather`` or ``Slice`` of such a Shape off the whole shape too: trtc folds the sliced Shapes it can itself and
  hides the others from it;
* its shape-tensor cast elision runs ``Cast(int -> float) -> op -> Cast(-> int)`` in integers, casting the op's
  float constants to integers (``int(size * 0.5)`` became ``size * 0``) and giving a comparison's bool output to a
  tensor its readers take as an int: trtc hides the nodes where that is not exact;
* it lowers ``Constant(value_float=...)`` to a float64 array: trtc makes it a float32 tensor first;
* it stores ONNX Runtime's list for a foldable sequence-valued node as one array, and its exporter cannot write
  optional or map values at all: such nodes are not evaluated, and a model with such values is not folded.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from compiler.core.onnx_io import MAX_IR_VERSION, apply_ort_log_severity, subgraphs

__all__ = ["fold_constants"]

log = logging.getLogger(__name__)


def fold_constants(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """Evaluate subgraphs whose inputs are all constant, and Shape nodes of static shapes (onnx-graphsurgeon,
    ONNX Runtime underneath), leaving alone what onnx-graphsurgeon would get wrong (see the module docstring).

    A ``Shape`` with ``start``/``end`` whose slice of dims is static is folded here; one whose slice is not static
    is hidden from onnx-graphsurgeon's shape folding, and a node its cast elision would make inexact is hidden from
    that. Shapes come from the model's value_info (``infer_shapes`` runs first in ``DEFAULT_PASSES``). A model with
    a value onnx-graphsurgeon cannot carry (an optional, a map, a sequence of sequences) is returned as it is, and
    nodes whose results are not tensors are not evaluated. The result has IR version 4 at least: onnx-graphsurgeon
    drops initializers from the graph inputs, which IR 3 requires them to be in.
    """
    import onnx_graphsurgeon as gs

    kept = _uncarried_value(model.graph)
    if kept is not None:
        log.info("constant folding skipped: onnx-graphsurgeon cannot carry the type of %s", kept)
        return model, {"nodes_folded": 0, "skipped": f"onnx-graphsurgeon cannot carry the type of {kept}"}
    graph = gs.import_onnx(model)
    before = len(graph.nodes)
    guards = _guarded(graph)
    apply_ort_log_severity()  # onnx-graphsurgeon's own ONNX Runtime sessions log at trtc's level

    graph.fold_constants(error_ok=True, flatten_subgraphs=False, should_exclude_node=_not_tensors)
    _unguarded(graph, guards)
    graph.cleanup()
    folded = _export(graph, model)
    # the graph is a reference cycle (nodes <-> tensors) whose constants hold ``model``'s weights: collected now,
    # not whenever the collector next runs (an idle process waiting on its calibration worker held them all along)
    del graph
    gc.collect()
    return folded, {"nodes_folded": before - len(folded.graph.node), "sliced_shapes_folded": guards.folded,
                    "kept_from_graphsurgeon": guards.names}


def _uncarried_value(graph: onnx.GraphProto) -> str | None:
    """The first value of ``graph`` (subgraphs included) whose type onnx-graphsurgeon's exporter cannot write (it
    writes tensors, sparse tensors and sequences of tensors), named with its type; None when there is none."""
    for info in [*graph.input, *graph.output, *graph.value_info]:
        kind = info.type.WhichOneof("value")
        if kind in (None, "tensor_type", "sparse_tensor_type"):
            continue
        if kind == "sequence_type" and info.type.sequence_type.elem_type.WhichOneof("value") == "tensor_type":
            continue
        return f"{info.name!r} ({kind.removesuffix('_type')})"
    for node in graph.node:
        for sub in subgraphs(node):
            found = _uncarried_value(sub)
            if found is not None:
                return found
    return None


# ops whose results are sequences or optionals: onnx-graphsurgeon would store ONNX Runtime's list as one array
_NOT_TENSOR_OPS = {"SequenceConstruct", "SequenceEmpty", "SequenceInsert", "SequenceErase", "SplitToSequence",
                   "Optional", "OptionalGetElement"}


def _not_tensors(node: Any) -> bool:
    """``should_exclude_node`` for onnx-graphsurgeon: a node whose results are not all tensors is not evaluated."""
    return node.op in _NOT_TENSOR_OPS or any(getattr(out, "type", "tensor_type") != "tensor_type"
                                             for out in node.outputs)


_GUARD = "trtc_fold_guard"  # name prefix of the Identity nodes that hide a node from onnx-graphsurgeon's folding
# the ops onnx-graphsurgeon's cast elision (Graph.fold_constants' run_cast_elision) runs in integers; exact for these
# when every input is an integer cast to float or an integral constant of its own
_ELIDED_EXACTLY = {"Add", "Sub", "Mul", "Div", "Max", "Min", "Concat"}
_ELIDED = _ELIDED_EXACTLY | {"Equal", "Greater", "Less"}  # a comparison's bool output would stand for an int


@dataclass
class _Guards:
    nodes: list[Any] = field(default_factory=list)  # (graph, identity) pairs
    names: list[str] = field(default_factory=list)  # the nodes kept from onnx-graphsurgeon
    folded: int = 0  # sliced Shapes folded here


def _guarded(graph: Any) -> _Guards:
    """``graph`` (subgraphs included) made safe for onnx-graphsurgeon's folding, in place: Constants typed, CastLikes
    of constants made Casts, static sliced Shapes folded, and a guard Identity after each node that its shape
    folding or cast elision would rewrite wrongly."""
    guards = _Guards()
    for g in [graph, *graph.subgraphs(recursive=True)]:
        for node in list(g.nodes):
            if node.op == "Constant":
                _typed_constant(node)
            elif node.op == "CastLike":
                _cast_of_constant(node)
            elif node.op == "Shape" and ("start" in node.attrs or "end" in node.attrs) and node.outputs:
                # onnx-graphsurgeon's fold_shapes reads the input's whole shape and ignores Shape-15's start/end
                dims = _sliced_dims(node)
                if dims is not None:
                    out = node.outputs[0]
                    out.to_constant(np.array(dims, dtype=np.int64))
                    out.inputs.clear()
                    guards.folded += 1
                else:
                    _guard(g, node, guards)
            elif node.op in _ELIDED and _cast_elision_inexact(g, node):
                _guard(g, node, guards)
    return guards


def _typed_constant(node: Any) -> None:
    """A Constant's ``value_float(s)``/``value_int(s)`` as a float32/int64 tensor: onnx-graphsurgeon makes a Python
    float a float64 array, so ``Constant(value_float=1.5)`` would fold into a double that its readers reject."""
    import onnx_graphsurgeon as gs

    dtypes = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64}
    if len(node.attrs) == 1 and next(iter(node.attrs)) in dtypes:
        key, value = next(iter(node.attrs.items()))
        if not isinstance(value, gs.Node.AttributeRef):
            node.attrs = {"value": gs.Constant(f"{node.outputs[0].name}_value", np.array(value, dtype=dtypes[key]))}


def _cast_of_constant(node: Any) -> None:
    """``CastLike(constant, x)`` as ``Cast(constant, to=x's type)`` where that type is known: the same by definition,
    and foldable (onnx-graphsurgeon folds only nodes whose inputs are all constant, and ``x`` is not)."""
    import onnx_graphsurgeon as gs

    source, like = node.inputs[0], node.inputs[1]
    constant = isinstance(source, gs.Constant) or (len(source.inputs) == 1 and source.inputs[0].op == "Constant")
    if not constant or not isinstance(like.dtype, (np.dtype, type)):
        return
    try:
        to = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(like.dtype))
    except (KeyError, TypeError, ValueError):  # a dtype numpy names but ONNX does not
        return
    node.op = "Cast"
    node.attrs = {"to": to, **({"saturate": node.attrs["saturate"]} if "saturate" in node.attrs else {})}
    node.inputs.pop()


def _sliced_dims(node: Any) -> list[int] | None:
    """The dims ``Shape(start, end)`` returns when its input's rank and those dims are static, else None."""
    shape = node.inputs[0].shape
    if shape is None:
        return None
    rank = len(shape)
    start, end = int(node.attrs.get("start", 0)), int(node.attrs.get("end", rank))
    dims = list(shape)[start:end]  # Python's slice clamps negative and out-of-range bounds as Shape-15 does
    if not all(isinstance(d, int) and d >= 0 for d in dims):
        return None
    return [int(d) for d in dims]


def _cast_elision_inexact(graph: Any, node: Any) -> bool:
    """Whether onnx-graphsurgeon's cast elision may rewrite ``node`` (an input cast to float, every output read only
    by Casts) and would change what it computes by running it in integers."""
    import onnx_graphsurgeon as gs

    from_cast = [t for t in node.inputs if len(t.inputs) == 1 and t.inputs[0].op == "Cast"
                 and t.inputs[0].attrs.get("to") == onnx.TensorProto.FLOAT]
    if not from_cast or not node.outputs:
        return False
    outputs_cast = all(out.outputs and all(c.op == "Cast" for c in out.outputs) for out in node.outputs)
    if not outputs_cast or any(out in graph.outputs for out in node.outputs):
        return False
    if node.op not in _ELIDED_EXACTLY or any(len(out.outputs) > 1 for out in node.outputs):
        return True  # a bool output in an int tensor; or two Casts, of which the rewiring keeps one
    for t in node.inputs:
        if t in from_cast:
            continue
        if not isinstance(t, gs.Constant) or len(t.outputs) > 1:
            return True  # a float variable next to the ints; or a constant whose other readers would see it cast
        values = np.asarray(t.values)
        if not (np.all(np.isfinite(values)) and np.all(values == np.round(values)) and
                np.all(np.abs(values) < 2**31)):
            return True  # 0.5 would become 0
    return False


def _guard(graph: Any, node: Any, guards: _Guards) -> None:
    """Put an Identity between ``node`` and the readers of its outputs: none of onnx-graphsurgeon's patterns match."""
    import onnx_graphsurgeon as gs

    index = graph.nodes.index(node)
    for k, out in enumerate(list(node.outputs)):
        hidden = gs.Variable(f"{out.name}__{_GUARD}", dtype=out.dtype, shape=out.shape)
        node.outputs[k] = hidden
        identity = gs.Node("Identity", f"{_GUARD}/{node.name or out.name}/{k}", inputs=[hidden], outputs=[out])
        graph.nodes.insert(index + 1 + k, identity)
        guards.nodes.append((graph, identity))
    guards.names.append(node.name or node.outputs[0].name)


def _unguarded(graph: Any, guards: _Guards) -> None:
    """Remove the guard Identities that folding left: each node writes its own output again."""
    for g, identity in guards.nodes:
        if identity not in g.nodes or not identity.inputs or not identity.outputs:
            continue  # folded away with its input
        hidden, out = identity.inputs[0], identity.outputs[0]
        producers = list(hidden.inputs)
        identity.inputs.clear()
        identity.outputs.clear()
        g.nodes.remove(identity)
        if producers:
            producer = producers[0]
            producer.outputs[producer.outputs.index(hidden)] = out
        else:  # the hidden tensor became a constant: so is the output
            import onnx_graphsurgeon as gs

            if isinstance(hidden, gs.Constant):
                out.to_constant(hidden.values)


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
    out.ir_version = max(4, min(like.ir_version or MAX_IR_VERSION, MAX_IR_VERSION))
    del out.opset_import[:]
    out.opset_import.extend(like.opset_import)
    out.producer_name, out.producer_version = like.producer_name, like.producer_version
    return out
