"""The comparison model of ``trtc diff``: a reference graph and a candidate graph in one ONNX model on the same
inputs, with every layer they share compared inside the graph and reduced there to a few sums.

The reference is the FP32 graph (or, for two builds, the first build's precision graph), the candidate a precision
graph of the same model. Layers are matched by ONNX node name (the passes and the precision rewrites keep them).
Each layer is compared twice:

* **accumulated**: the candidate's output of the layer against the reference's: the precision graph end to end;
* **isolated**: the layer as the candidate runs it (its Q/DQ, casts and reduced weights: the nodes between it and
  the tensors both graphs hold, copied from the candidate), fed the reference's own inputs to it, against the
  reference's output: what the layer loses alone, whatever the layers before it lost.

Each comparison leaves ONNX Runtime as seven scalars (sums of squares of the difference, of the reference, of the
candidate, their dot product, the max |difference| and both element counts), so what a run returns does not grow
with the number of layers or their size: only the activations of the run itself take memory.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import TensorProto, helper

from calibration.fp16 import QDQ_NODE_TYPES
from calibration.fp16_rounding import fp16_rounding_emulation
from calibration.weights import raise_opset
from compiler.core.errors import InputError
from compiler.core.onnx_io import MAX_IR_VERSION, FreshNames, weightless_copy

__all__ = ["Layer", "Comparison", "ComparisonModel", "comparison_model", "layer_precisions", "tensor_types",
           "STATS", "NOT_LAYERS", "INTEGER"]

log = logging.getLogger(__name__)

# nodes that are no layer of their own: a precision's Q/DQ and casts, and shape bookkeeping (node_precisions' set)
NOT_LAYERS = QDQ_NODE_TYPES | {"Constant", "Shape", "Size", "Cast"}
# the nodes a precision puts between a layer and the tensors both graphs hold: an isolated layer runs them too
_AROUND_A_LAYER = QDQ_NODE_TYPES | {"Cast"}
_FLOATS = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16, TensorProto.DOUBLE})
_QUANTIZED: dict[int, str] = {
    TensorProto.INT8: "int8", TensorProto.UINT8: "int8", TensorProto.INT4: "int4", TensorProto.UINT4: "int4",
    TensorProto.FLOAT8E4M3FN: "fp8", TensorProto.FLOAT8E4M3FNUZ: "fp8", TensorProto.FLOAT8E5M2: "fp8",
    TensorProto.FLOAT8E5M2FNUZ: "fp8"}
_FLOAT_NAMES: dict[int, str] = {TensorProto.FLOAT16: "fp16", TensorProto.BFLOAT16: "bf16"}
_ORDER = ("int4", "fp8", "int8")  # a layer with INT4 weights and INT8 inputs is listed as INT4
# the sums of one comparison, in the order of its outputs
STATS = ("diff_sq", "ref_sq", "got_sq", "dot", "max_abs", "count", "got_count")
CANDIDATE = "candidate/"
INTEGER = "integer"


@dataclass(frozen=True)
class Layer:
    """A layer both graphs hold: its node ``name``, ``op_type``, its ``precision`` in the candidate (``int8``,
    ``fp8``, ``int4``, ``fp16``, ``bf16`` or ``fp32``), ``depth`` (its index among the compared layers in graph
    order) and ``upstream``: the compared layers whose outputs reach it with no compared layer between."""

    name: str
    op_type: str
    precision: str
    depth: int
    upstream: tuple[str, ...] = ()


@dataclass(frozen=True)
class Comparison:
    """One compared tensor: ``name`` (the layer, or the graph output), ``kind`` (``isolated``, ``accumulated`` or
    ``output``) and the names of its seven outputs (``STATS``)."""

    name: str
    kind: str
    outputs: tuple[str, ...]


@dataclass
class ComparisonModel:
    model: onnx.ModelProto
    layers: list[Layer]
    comparisons: list[Comparison]
    not_isolated: dict[str, str] = field(default_factory=dict)  # layer -> why it has no isolated error


def tensor_types(model: onnx.ModelProto) -> dict[str, int]:
    """The element type of every tensor of ``model``'s main graph that shape inference can tell (weights not read)."""
    typed = onnx.shape_inference.infer_shapes(weightless_copy(model))
    graph = typed.graph
    types = {vi.name: vi.type.tensor_type.elem_type for vi in [*graph.input, *graph.output, *graph.value_info]
             if vi.type.HasField("tensor_type")}
    types.update({t.name: t.data_type for t in model.graph.initializer})
    return types


def _names(graph: onnx.GraphProto) -> list[str]:
    return [node.name or f"{node.op_type}_{i}" for i, node in enumerate(graph.node)]


def layer_precisions(model: onnx.ModelProto, types: dict[str, int] | None = None) -> dict[str, str]:
    """The precision of every layer of ``model`` (its nodes but Q/DQ, Cast, Constant, Shape, Size), in graph order.

    A layer that reads a DequantizeLinear runs in the precision of the quantized values (``int8``, ``fp8``,
    ``int4``); else in the type of its first output (``fp16``, ``bf16``; ``INTEGER`` for integer or bool outputs:
    shape arithmetic, which no precision changes), else ``fp32``. Unnamed nodes are
    ``OpType_index``. Reads the graph, not the weights.
    """
    types = tensor_types(model) if types is None else types
    producers = {o: node for node in model.graph.node for o in node.output}
    found = {}
    for name, node in zip(_names(model.graph), model.graph.node):
        if node.op_type in NOT_LAYERS:
            continue
        kinds = set()
        for tensor in node.input:
            source = producers.get(tensor)
            if source is not None and source.op_type == "DequantizeLinear" and source.input:
                kind = _QUANTIZED.get(types.get(source.input[0], 0))
                if kind:
                    kinds.add(kind)
        out_type = types.get(node.output[0], 0) if node.output else 0
        if kinds:
            found[name] = next(k for k in _ORDER if k in kinds)
        elif out_type and out_type not in _FLOATS:
            found[name] = INTEGER  # shape arithmetic, indices, masks
        else:
            found[name] = _FLOAT_NAMES.get(out_type, "fp32")
    return found


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _holds_fp16(types: dict[str, int]) -> bool:
    return TensorProto.FLOAT16 in types.values()


class _Builder:
    """Appends nodes with fresh names to the merged graph."""

    def __init__(self, graph: onnx.GraphProto) -> None:
        self.graph = graph
        self.fresh = FreshNames(graph)

    def node(self, op: str, inputs: list[str], base: str, **attrs: Any) -> str:
        out = self.fresh(base)
        self.graph.node.append(helper.make_node(op, inputs, [out], name=self.fresh(f"{out}_node"), **attrs))
        return out


def _rename_graph(graph: onnx.GraphProto, rename: Callable[[str], str]) -> None:
    """Every tensor and node name of ``graph`` (and of its subgraphs) through ``rename``, in place."""
    for node in graph.node:
        node.name = rename(node.name) if node.name else node.name
        for i, name in enumerate(node.input):
            node.input[i] = rename(name) if name else name
        for i, name in enumerate(node.output):
            node.output[i] = rename(name) if name else name
        for attr in node.attribute:
            for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
                _rename_graph(sub, rename)
    for items in (graph.initializer, graph.sparse_initializer, graph.input, graph.output, graph.value_info):
        for item in items:
            if hasattr(item, "name"):
                item.name = rename(item.name)
            elif hasattr(item, "values"):
                item.values.name = rename(item.values.name)


def comparison_model(reference: onnx.ModelProto, candidate: onnx.ModelProto, emulate_fp16: bool = False,
                     outputs: bool = True) -> ComparisonModel:
    """The two graphs in one model on ``reference``'s inputs, every shared layer compared isolated and accumulated.

    ``candidate``'s inputs must be among ``reference``'s (by name). ``emulate_fp16``: the candidate runs as
    ``fp16_rounding_emulation`` has it (for ONNX Runtime's CPU provider, which would keep FP32 values between FP16
    nodes), its isolated layers too. ``outputs``: the graph outputs both hold are compared as well. The models
    may be loaded by reference (``load_onnx_by_reference``): no weight is read here but FP16 weights under
    emulation. Raises InputError when the graphs take different inputs.
    """
    if _opset(reference) < _opset(candidate):
        reference = raise_opset(reference, _opset(candidate))
    elif _opset(candidate) < _opset(reference):
        candidate = raise_opset(candidate, _opset(reference))
    inputs = {i.name for i in reference.graph.input}
    missing = [i.name for i in candidate.graph.input if i.name not in inputs]
    if missing:
        raise InputError(f"the graphs take different inputs (the second has {', '.join(missing)}); compare builds "
                         "of the same model")
    ref_types, cand_types = tensor_types(reference), tensor_types(candidate)
    precisions = layer_precisions(candidate, cand_types)
    emulate = emulate_fp16 and _holds_fp16(cand_types)
    run = fp16_rounding_emulation(candidate) if emulate else candidate
    layout = reference  # node names and tensor names as the graph has them (emulation keeps both, and adds)
    if emulate_fp16 and _holds_fp16(ref_types):  # two precision graphs: the first one rounds as FP16 does too
        reference = fp16_rounding_emulation(reference)
    held_types = {name: TensorProto.FLOAT if emulate_fp16 and kind == TensorProto.FLOAT16 else kind
                  for name, kind in ref_types.items()}

    view = weightless_copy(run) if emulate else run  # the candidate's names, for the isolated copies
    if emulate:
        merged = run  # made here: renamed in place, so that its FP32 weights are never copied
    else:
        merged = onnx.ModelProto()
        merged.CopyFrom(run)  # by reference: no weight is in the proto
    merged.ir_version = min(max(reference.ir_version, candidate.ir_version), MAX_IR_VERSION)
    versions = {o.domain or "": o.version for o in reference.opset_import}
    for o in candidate.opset_import:
        versions[o.domain or ""] = max(versions.get(o.domain or "", 0), o.version)
    del merged.opset_import[:]
    merged.opset_import.extend(helper.make_opsetid(domain, version) for domain, version in versions.items())
    known = {(f.domain, f.name) for f in candidate.functions}
    merged.functions.extend(f for f in reference.functions if (f.domain, f.name) not in known)

    def rename(name: str) -> str:
        return name if name in inputs else CANDIDATE + name

    graph = merged.graph
    _rename_graph(graph, rename)
    for items in (graph.input, graph.output, graph.value_info):
        del items[:]
    graph.input.extend(reference.graph.input)
    candidate_nodes = len(graph.node)
    graph.node.extend(reference.graph.node)
    graph.initializer.extend(reference.graph.initializer)  # by reference (or FP16-emulated: a second build's)
    graph.sparse_initializer.extend(reference.graph.sparse_initializer)
    ranks = [j / max(1, candidate_nodes) for j in range(candidate_nodes)]
    ranks += [i / max(1, len(reference.graph.node)) for i in range(len(reference.graph.node))]

    build = _Builder(merged.graph)
    ref_nodes = dict(zip(_names(layout.graph), layout.graph.node))
    cand_nodes = dict(zip(_names(candidate.graph), candidate.graph.node))
    shared = [name for name, node in ref_nodes.items() if node.op_type not in NOT_LAYERS and node.output
              and name in cand_nodes and cand_nodes[name].op_type == node.op_type and cand_nodes[name].output
              and ref_types.get(node.output[0]) in _FLOATS]
    layers = _layers(layout, shared, precisions)
    cones = _Cones(view, reference, build, cand_types, held_types, emulate, rename)
    position = {name: i / max(1, len(ref_nodes)) for i, name in enumerate(ref_nodes)}
    comparisons, not_isolated = [], {}
    for layer in layers:
        ref_out, cand_out = ref_nodes[layer.name].output[0], cand_nodes[layer.name].output[0]
        try:
            isolated = cones.isolated(layer.name, cand_out)
        except _NotIsolable as err:
            not_isolated[layer.name] = str(err)
        else:
            ranks += [position[layer.name]] * (len(graph.node) - len(ranks))  # the copy runs beside the layer
            comparisons.append(Comparison(layer.name, "isolated", _stats(build, isolated, ref_out)))
        comparisons.append(Comparison(layer.name, "accumulated", _stats(build, rename(cand_out), ref_out)))
        ranks += [-1.0] * (len(graph.node) - len(ranks))  # the sums run as soon as both sides are there
    if outputs:
        cand_outputs = {o.name for o in candidate.graph.output}
        for out in layout.graph.output:
            if out.name in cand_outputs and ref_types.get(out.name) in _FLOATS:
                comparisons.append(Comparison(out.name, "output", _stats(build, rename(out.name), out.name)))
    pairs = [(rename(cand_nodes[layer.name].output[0]), ref_nodes[layer.name].output[0]) for layer in layers]
    _in_lockstep(build, pairs, range(candidate_nodes), range(candidate_nodes, candidate_nodes + len(layout.graph.node)))
    ranks += [-1.0] * (len(graph.node) - len(ranks))
    _run_in_step(graph, ranks)
    for comparison in comparisons:
        for name, stat in zip(comparison.outputs, STATS):
            kind = TensorProto.INT64 if stat.endswith("count") else TensorProto.FLOAT
            graph.output.append(helper.make_tensor_value_info(name, kind, []))
    log.info("comparing %d layers (%d isolated) and %d outputs", len(layers), len(layers) - len(not_isolated),
             sum(c.kind == "output" for c in comparisons))
    return ComparisonModel(merged, layers, comparisons, not_isolated)


def _in_lockstep(build: _Builder, pairs: list[tuple[str, str]], candidate: range, reference: range) -> None:
    """Make each graph's next layers wait for the other graph's output of each compared layer, so that neither runs
    ahead holding its compared tensors until the other catches up (ONNX Runtime runs fused nodes late, in the order
    it made them). Past each compared pair (c, r) the candidate's layers read ``Reshape(c, Shape(r))`` and the
    reference's ``Reshape(r, Shape(c))``: the same values (a reshape to its own shape, no copy on ONNX Runtime's
    CPU), with the other tensor as a dependency. The comparisons themselves read c and r."""
    graph = build.graph
    waits: dict[str, str] = {}
    for c, r in pairs:
        for mine, other in ((c, r), (r, c)):
            if mine not in waits:
                shape = build.node("Shape", [other], f"{mine}_waits_shape")
                waits[mine] = build.node("Reshape", [mine, shape], f"{mine}_waits")
    for k in [*candidate, *reference]:
        node = graph.node[k]
        for i, name in enumerate(node.input):
            if name in waits:
                node.input[i] = waits[name]


def _run_in_step(graph: onnx.GraphProto, ranks: list[float]) -> None:
    """Order ``graph``'s nodes so that both graphs advance together and each comparison's sums run as soon as its
    two tensors exist (the session runs in node order): a compared tensor is freed once its sums ran, so a run
    holds about what the two graphs' own inference holds. ``ranks``: per node, how far along its graph it is (0 to
    1; -1 for as soon as it can run). A topological sort (Kahn's) that always takes the lowest rank ready."""
    nodes = list(graph.node)
    producer = {o: k for k, node in enumerate(nodes) for o in node.output if o}
    users: list[list[int]] = [[] for _ in nodes]
    waiting = [0] * len(nodes)
    for k, node in enumerate(nodes):
        for p in {producer[t] for t in [*node.input, *_outer(node)] if t in producer and producer[t] != k}:
            users[p].append(k)
            waiting[k] += 1
    ready = [(ranks[k], k) for k in range(len(nodes)) if not waiting[k]]
    heapq.heapify(ready)
    order = []
    while ready:
        _, k = heapq.heappop(ready)
        order.append(k)
        for user in users[k]:
            waiting[user] -= 1
            if not waiting[user]:
                heapq.heappush(ready, (ranks[user], user))
    if len(order) != len(nodes):
        log.debug("the comparison graph has a cycle: its nodes stay in their order")
        return
    del graph.node[:]
    graph.node.extend(nodes[k] for k in order)


def _layers(reference: onnx.ModelProto, shared: list[str], precisions: dict[str, str]) -> list[Layer]:
    """The shared layers in the reference's graph order, each with the compared layers just upstream of it."""
    wanted = set(shared)
    reaching: dict[str, frozenset[str]] = {}  # tensor -> the compared layers whose output reaches it directly
    found: list[Layer] = []
    for name, node in zip(_names(reference.graph), reference.graph.node):
        upstream = frozenset().union(*(reaching.get(t, frozenset()) for t in node.input))
        if name in wanted:
            found.append(Layer(name, node.op_type, precisions.get(name, "fp32"), len(found), tuple(sorted(upstream))))
            upstream = frozenset({name})
        for out in node.output:
            reaching[out] = upstream
    return found


class _NotIsolable(Exception):
    pass


class _Cones:
    """Copies of a candidate layer and the Q/DQ and casts before it, reading the reference's tensors."""

    def __init__(self, run: onnx.ModelProto, reference: onnx.ModelProto, build: _Builder, types: dict[str, int],
                 held_types: dict[str, int], emulate: bool, rename: Callable[[str], str]) -> None:
        self.build, self.types, self.emulate, self.rename = build, types, emulate, rename
        self.held_types = held_types  # the reference's types, as it runs
        graph = run.graph
        self.producers = {o: node for node in graph.node for o in node.output if o}
        self.by_name = dict(zip(_names(graph), graph.node))
        varying = {i.name for i in reference.graph.input}  # the view may list weights as inputs: not these
        for node in graph.node:
            if any(t in varying for t in [*node.input, *_outer(node)]):
                varying.update(node.output)
        self.varying = varying  # tensors that depend on the inputs: the rest are the candidate's constants
        self.held = {i.name for i in reference.graph.input} | {o for n in reference.graph.node for o in n.output}
        self.boundaries: dict[str, str] = {}
        self.walks: dict[str, bool] = {}

    def isolated(self, layer: str, output: str) -> str:
        """The name of the isolated copy of ``layer``'s ``output`` (the candidate's name of it)."""
        node = self.by_name.get(layer)
        if node is None or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
                               for a in node.attribute):
            raise _NotIsolable("a control-flow node" if node is not None else "not in the graph that runs")
        prefix = f"isolated/{layer}/"
        copies: dict[str, str] = {}

        def value(tensor: str, target: bool = False) -> str:
            if not tensor:
                return ""
            if tensor in copies:
                return copies[tensor]
            if tensor not in self.varying:
                result = self.rename(tensor)  # a constant of the candidate: its weights, scales, shapes
            elif not target and tensor in self.held and not self.walkable(tensor):
                result = self.boundary(tensor)
            else:
                source = self.producers.get(tensor)
                if source is None or (source is not node and source.op_type not in _AROUND_A_LAYER):
                    raise _NotIsolable(f"its input {tensor} comes from {source.op_type if source else 'nowhere'}, "
                                       "which the reference does not hold")
                # between the layer and its output (the rounding casts of emulation) nothing is the reference's
                ins = [value(t, target=target and source is not node) for t in source.input]
                copy = onnx.NodeProto()
                copy.CopyFrom(source)
                copy.name = self.build.fresh(prefix + (source.name or source.op_type))
                del copy.input[:]
                copy.input.extend(ins)
                outs = [self.build.fresh(prefix + o) if o else "" for o in source.output]
                del copy.output[:]
                copy.output.extend(outs)
                self.build.graph.node.append(copy)
                for o, new in zip(source.output, outs):
                    copies[o] = new
                result = copies[tensor]
            copies[tensor] = result
            return result

        return value(output, target=True)

    def walkable(self, tensor: str) -> bool:
        """Whether ``tensor`` comes from Q/DQ and casts of constants and of tensors the reference holds: the
        candidate's own precision, even where the reference holds a tensor of the same name (another build's Q/DQ)."""
        if tensor not in self.walks:
            self.walks[tensor] = False  # a cycle is no walk
            source = self.producers.get(tensor)
            self.walks[tensor] = tensor not in self.varying or (
                source is not None and source.op_type in _AROUND_A_LAYER
                and all(t in self.held or self.walkable(t) for t in source.input if t))
        return self.walks[tensor]

    def boundary(self, tensor: str) -> str:
        """The reference's ``tensor`` in the candidate's type: FP16 (rounded in FP32 under emulation) where the
        candidate holds it in FP16."""
        if tensor not in self.boundaries:
            want, have = self.types.get(tensor), self.held_types.get(tensor, TensorProto.FLOAT)
            result = tensor
            if want == TensorProto.FLOAT16 and self.emulate:
                half = self.build.node("Cast", [tensor], f"{tensor}_isolated_fp16", to=TensorProto.FLOAT16)
                result = self.build.node("Cast", [half], f"{tensor}_isolated_rounded", to=TensorProto.FLOAT)
            elif want in _FLOATS and want != have:
                result = self.build.node("Cast", [tensor], f"{tensor}_isolated_cast", to=want)
            self.boundaries[tensor] = result
        return self.boundaries[tensor]


def _outer(node: onnx.NodeProto) -> Iterable[str]:
    """Names a node's subgraphs read from the graph around them (an over-approximation: every input they name)."""
    for attr in node.attribute:
        for sub in [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs):
            for inner in sub.node:
                yield from inner.input
                yield from _outer(inner)


def _stats(build: _Builder, got: str, ref: str) -> tuple[str, ...]:
    """The seven sums of ``got`` against ``ref`` (``STATS``), computed in FP32 inside the graph."""
    base = ref.replace("/", "_")
    g = build.node("Cast", [got], f"{base}_got", to=TensorProto.FLOAT)
    r = build.node("Cast", [ref], f"{base}_ref", to=TensorProto.FLOAT)
    d = build.node("Sub", [g, r], f"{base}_diff")
    return (build.node("ReduceSumSquare", [d], f"{base}_diff_sq", keepdims=0),
            build.node("ReduceSumSquare", [r], f"{base}_ref_sq", keepdims=0),
            build.node("ReduceSumSquare", [g], f"{base}_got_sq", keepdims=0),
            build.node("ReduceSum", [build.node("Mul", [g, r], f"{base}_prod")], f"{base}_dot", keepdims=0),
            build.node("ReduceMax", [build.node("Abs", [d], f"{base}_abs")], f"{base}_max_abs", keepdims=0),
            build.node("Size", [r], f"{base}_count"),
            build.node("Size", [g], f"{base}_got_count"))
