"""Insert INT8 or FP8 QuantizeLinear/DequantizeLinear (Q/DQ) pairs where TensorRT can fuse them.

TensorRT 11 is strongly typed: INT8 exists only where the ONNX graph says so with explicit Q/DQ nodes. This
stage turns a folded FP32 graph plus one calibrated ``amax`` per activation tensor into such a graph.

Where: every placement decision is one entry of ``PLACEMENT`` (op type -> all of that op's rules, and why), in
the spirit of ONNX Runtime's quantization registry, following TensorRT's Q/DQ placement guide and ModelOpt.
Weighted ops (Conv, ConvTranspose, Gemm, MatMul with a constant weight) get Q/DQ on their *inputs*, unless a
layer has fewer than 16 input or output channels (a 1- or 3-channel stem conv, a GEMV-like MatMul: INT8 gains
nothing there and only adds error) or is the model's head (a Gemm/MatMul whose result is a graph output). A
ResNet residual ``Add(conv_output, shortcut)`` gets it on the shortcut, so that TensorRT fuses the add into the
convolution, as ModelOpt does; transformer residual and bias adds get nothing. Pools after a quantized layer,
and concats whose output is quantized, follow. Attention score products (MatMul of two activations, ``Q·K^T``
and ``attn·V``) stay in higher precision unless :attr:`QdqPolicy.quantize_attention_matmuls`. Nothing before
Relu, Softmax, LayerNormalization, Gelu or other element-wise operators, nothing on biases and nothing on
graph outputs: TensorRT cannot fuse Q/DQ there and would run extra reformat kernels.

How: symmetric INT8, zero point 0, ``scale = amax / 127``; one Q/DQ pair per activation tensor, shared by
every quantized consumer, so TensorRT sees one scale per tensor, and only quantized consumers read it. Weights
get one scale per output channel and are stored as INT8 initializers followed by a DequantizeLinear only (no
QuantizeLinear): TensorRT accepts pre-quantized weights behind a DQ layer (its explicit quantization guide) and
ONNX Runtime runs the same graph on CPU, so both execute exactly the same INT8 values; the file is about 4x
smaller than with FP32 weights plus a Q/DQ pair, and no rounding happens later at engine build time. Only
weights that are constant initializers are quantized; a folding pass upstream turns Constant nodes into
initializers.

FP8 (``QdqPolicy(precision="fp8")``, TensorRT's E4M3 on GPUs of compute capability 8.9+): the same placement
where ``PLACEMENT`` marks an op ``fp8`` (the convolutions and GEMMs), ``float8e4m3fn`` zero points,
``scale = amax / 448``, weights stored as FP8 behind their DequantizeLinear (``calibration/weights.py``); opset 19.

What this module will not do: choose amax values (calibration/statistics.py does), quantize
inside subgraphs (If/Loop bodies), or quantize operators whose weight is not an initializer.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from calibration.weights import (
    FP8,
    FP8_MAX,
    INT8_MAX,
    WeightChannels,
    conv_transpose_weight,
    conv_weight,
    fp8_weight,
    gemm_weight,
    int8_weight,
    matmul_weight,
    scale_for,
)
from compiler.core.onnx_io import MAX_IR_VERSION, FreshNames, copy_fields, tensor_array

__all__ = ["PLACEMENT", "OpRule", "WeightChannels", "QDQ_PRECISIONS", "QdqPolicy", "QdqReport", "tensors_to_calibrate",
           "quantizable_nodes", "placement", "node_names", "qdq_model_from"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OpRule:
    """All of one operator type's Q/DQ rules, and why (one line). ``kind`` says which rule applies:

    * ``"weighted"``: the activation input per tensor, the constant weight (input 1) per output channel, as
      ``weight`` reads the channels from the node and the weight's dims. A layer with fewer than
      ``min_channels`` input or output channels stays in higher precision, for the reason ``too_small`` (filled
      with ``inputs``, ``outputs`` and ``limit``). ``two_activations``: the op may multiply two activations
      (attention's Q·K^T, attn·V), both then quantized per tensor only with
      ``QdqPolicy.quantize_attention_matmuls``; else a weight that is not a constant leaves it unquantized.
      ``head_through``: a node whose result reaches a graph output through single readers of these op types is
      the model's head, kept in higher precision unless ``QdqPolicy.quantize_output_layer`` (one small layer
      whose error lands on the outputs unfiltered); empty: no head rule.
    * ``"residual"``: the shortcut of an add TensorRT fuses into a producer of a ``fuses_into`` type.
    * ``"pool"``: the input, only where it comes from a quantized layer (through ``source_through`` ops).
    * ``"concat"``: every input, with one scale shared by the inputs and the output, only where the output is
      quantized.

    FP8 (``QdqPolicy.precision == "fp8"``) applies the same rule where ``fp8`` is True; elsewhere ``not_fp8`` says
    why the op stays out of FP8 (TensorRT runs FP8 in its convolution and GEMM kernels only). INT4 weight-only
    (``calibration/int4.py``) takes the weighted layers whose ``int4`` is True, with the same exclusions;
    ``not_int4`` says why the others keep their weights.
    """

    kind: Literal["weighted", "residual", "pool", "concat"]
    inputs: tuple[int, ...]
    why: str
    weight: Callable[[onnx.NodeProto, Sequence[int]], WeightChannels] | None = None
    min_channels: int = 0
    too_small: str = ""
    two_activations: bool = False
    head_through: frozenset[str] = frozenset()
    fuses_into: frozenset[str] = frozenset()
    source_through: frozenset[str] = frozenset()
    fp8: bool = False
    not_fp8: str = ""
    int4: bool = False
    not_int4: str = ""


_FEW_CHANNELS = ("{inputs} input / {outputs} output channels: under {limit}, {precision} gains nothing and only adds "
                 "error")
_GEMV = "weight {inputs}x{outputs}: a dimension under {limit} (a GEMV in effect), {precision} gains nothing"
_NO_FP8_POOL = "TensorRT pools in FP16, not FP8: a Q/DQ here would only add a reformat"
_NO_INT4_CONV = "TensorRT's INT4 weight-only kernels are GEMMs: convolutions keep FP16 weights"

# The placement policy: every operator type that can get Q/DQ, all its rules and why. Anything else gets none.
# Not quantized, by design: Relu, Softmax, LayerNormalization, Gelu, bias adds and other element-wise ops
# (TensorRT fuses Q/DQ into them or cannot use INT8 there, and would run reformat kernels); graph outputs.
PLACEMENT: dict[str, OpRule] = {
    "Conv": OpRule("weighted", (0, 1), "TensorRT runs INT8 convolutions with the Q/DQ pair fused in",
                   weight=conv_weight, min_channels=16, too_small=_FEW_CHANNELS, fp8=True,
                   not_int4=_NO_INT4_CONV),
    "ConvTranspose": OpRule("weighted", (0, 1), "INT8 deconvolution, as Conv",
                            weight=conv_transpose_weight, min_channels=16, too_small=_FEW_CHANNELS, fp8=True,
                            not_int4=_NO_INT4_CONV),
    "Gemm": OpRule("weighted", (0, 1), "INT8 GEMM; weight channels along transB",
                   weight=gemm_weight, min_channels=16, too_small=_GEMV, two_activations=True,
                   head_through=frozenset({"Add", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity",
                                           "Transpose"}), fp8=True, int4=True),
    "MatMul": OpRule("weighted", (0, 1), "INT8 GEMM with a constant weight [..., K, N]; attention score "
                     "products only with quantize_attention_matmuls",
                     weight=matmul_weight, min_channels=16, too_small=_GEMV, two_activations=True,
                     head_through=frozenset({"Add", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Identity",
                                             "Transpose"}), fp8=True, int4=True),
    "Add": OpRule("residual", (0, 1), "a residual add fused into its convolution's epilogue (INT8 shortcut), "
                  "as ModelOpt; bias and transformer residual adds stay unquantized",
                  fuses_into=frozenset({"Conv", "ConvTranspose"}),
                  not_fp8="TensorRT fuses no FP8 shortcut into a convolution: the add runs in FP16 after it (and an "
                          "attention mask's -3.4e38 bias, added here in transformers, has no FP8 scale)"),
    "MaxPool": OpRule("pool", (0,), "INT8 pooling after a quantized layer saves a dequantize and a requantize",
                      source_through=frozenset({"Relu", "Clip", "LeakyRelu"}), not_fp8=_NO_FP8_POOL),
    "AveragePool": OpRule("pool", (0,), "INT8 pooling after a quantized layer, as MaxPool",
                          source_through=frozenset({"Relu", "Clip", "LeakyRelu"}), not_fp8=_NO_FP8_POOL),
    "GlobalAveragePool": OpRule("pool", (0,), "INT8 pooling after a quantized layer, as MaxPool",
                                source_through=frozenset({"Relu", "Clip", "LeakyRelu"}), not_fp8=_NO_FP8_POOL),
    "Concat": OpRule("concat", (), "one scale for all inputs and the output lets TensorRT concatenate in INT8 "
                     "without requantizing (every input index: the op is variadic)",
                     not_fp8="TensorRT concatenates FP8 tensors in no kernel of its own: the inputs meet in FP16"),
}

QDQ_PRECISIONS = ("int8", "fp8")  # what qdq_model_from writes
_MIN_OPSET = {"int8": 13, "fp8": 19}  # per-axis QuantizeLinear/DequantizeLinear; FP8 types


def _as_name_set(value: Any, what: str) -> frozenset[str]:
    if isinstance(value, str):
        raise TypeError(f"QdqPolicy.{what} must be a collection of names, not the string {value!r}")
    return frozenset(value)


@dataclass(frozen=True)
class QdqPolicy:
    """Which nodes get INT8 Q/DQ. Defaults follow TensorRT's recommendations.

    ``exclude_nodes`` and ``exclude_op_types`` keep nodes in higher precision (no Q/DQ on any of
    their inputs); the accuracy gate uses ``exclude_nodes`` for its fallback. Any iterable of
    names is accepted and stored as a frozenset.
    """

    precision: str = "int8"  # a QDQ_PRECISIONS entry: INT8, or FP8 E4M3 where PLACEMENT's rules allow it
    quantize_attention_matmuls: bool = False
    quantize_residual_add: bool = True
    quantize_output_layer: bool = False  # the Gemm/MatMul feeding a graph output
    min_channels: bool = True  # apply PLACEMENT's min_channels (False: quantize small layers too)
    exclude_nodes: frozenset[str] = frozenset()
    exclude_op_types: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        object.__setattr__(self, "exclude_nodes", _as_name_set(self.exclude_nodes, "exclude_nodes"))
        object.__setattr__(self, "exclude_op_types", _as_name_set(self.exclude_op_types, "exclude_op_types"))
        if self.precision not in QDQ_PRECISIONS:
            raise ValueError(f"QdqPolicy.precision {self.precision!r}: use one of {', '.join(QDQ_PRECISIONS)}")


@dataclass
class QdqReport:
    """What :func:`qdq_model_from` did.

    ``qdq_pairs`` counts activation tensors given a QuantizeLinear -> DequantizeLinear pair;
    ``quantized_weights`` counts weights stored as INT8 behind a DequantizeLinear.
    """

    quantized_nodes: list[str] = field(default_factory=list)
    skipped_nodes: dict[str, str] = field(default_factory=dict)
    qdq_pairs: int = 0
    quantized_weights: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"quantized_nodes": list(self.quantized_nodes), "skipped_nodes": dict(self.skipped_nodes),
                "qdq_pairs": self.qdq_pairs, "quantized_weights": self.quantized_weights}


@dataclass(frozen=True)
class _QuantizedInput:
    """One input of a node that gets Q/DQ: an activation (per tensor) or a constant weight."""

    index: int
    tensor: str
    is_weight: bool = False
    axis: int | None = None  # weights only: the per-channel axis, None for one scale


@dataclass(frozen=True)
class _Plan:
    """Which inputs of which nodes get Q/DQ (node names in graph order), and why others do not."""

    inputs: dict[str, tuple[_QuantizedInput, ...]]
    skipped: dict[str, str]
    activations: list[str]  # in the order the graph produces them, no duplicates
    scale_groups: dict[str, frozenset[str]] = field(default_factory=dict)  # tensors that share one scale


def node_names(graph: onnx.GraphProto) -> list[str]:
    """Node names, with a stable stand-in for unnamed nodes so policies can still name them."""
    return [node.name or f"{node.op_type}_{i}" for i, node in enumerate(graph.node)]


def _constants(graph: onnx.GraphProto) -> dict[str, onnx.TensorProto]:
    """Initializers that are true constants (an initializer also listed as a graph input can be overridden)."""
    graph_inputs = {i.name for i in graph.input}
    return {t.name: t for t in graph.initializer if t.name not in graph_inputs}


def _weighted_inputs(node: onnx.NodeProto, rule: OpRule, constants: Mapping[str, onnx.TensorProto],
                     policy: QdqPolicy) -> tuple[tuple[_QuantizedInput, ...], str]:
    """The inputs of a weighted node to quantize, or () and the reason it stays in higher precision."""
    indices = [i for i in rule.inputs if i < len(node.input) and node.input[i]]
    data, weight = node.input[0], node.input[1] if len(node.input) > 1 else ""
    if not data or not weight:
        return (), "missing data or weight input"
    if data in constants and weight in constants:
        return (), "both inputs are constant; TensorRT folds it at build time"
    if data in constants:
        return (), "constant first input: not a linear layer TensorRT fuses with Q/DQ"
    if weight not in constants:
        if not rule.two_activations:
            return (), "weight is not a constant initializer"
        if not policy.quantize_attention_matmuls:
            return (), "attention score product kept in FP32 (policy)"
        return tuple(_QuantizedInput(i, node.input[i]) for i in indices), ""
    w = constants[weight]
    if w.data_type != TensorProto.FLOAT:
        return (), f"weight is {TensorProto.DataType.Name(w.data_type)}, not FLOAT"
    # a weight of rank < 2 has no channels: one scale, and no size rule
    channels = rule.weight(node, w.dims) if rule.weight is not None and len(w.dims) >= 2 else None
    limit = rule.min_channels if policy.min_channels else 0
    if channels is not None and min(channels.inputs, channels.outputs) < limit:
        return (), rule.too_small.format(inputs=channels.inputs, outputs=channels.outputs, limit=limit,
                                         precision=policy.precision.upper())
    planned = [_QuantizedInput(i, node.input[i]) for i in indices if i != 1]
    planned.append(_QuantizedInput(1, weight, is_weight=True, axis=channels.axis if channels is not None else None))
    return tuple(sorted(planned, key=lambda q: q.index)), ""


def _head(node: onnx.NodeProto, through: frozenset[str], readers: Mapping[str, list[onnx.NodeProto]],
          graph_outputs: set[str]) -> bool:
    """True if ``node``'s output reaches a graph output through single readers of ``through`` op types only."""
    tensor, seen = node.output[0] if node.output else "", 0
    while tensor and seen < 8:
        if tensor in graph_outputs:
            return True
        after = readers.get(tensor, [])
        if len(after) != 1 or after[0].op_type not in through or not after[0].output:
            return False
        tensor, seen = after[0].output[0], seen + 1
    return False


def _depths(graph: onnx.GraphProto) -> dict[str, int]:
    """Longest path, in nodes, from the graph inputs to each tensor (graph nodes are topologically sorted)."""
    depth: dict[str, int] = {}
    for node in graph.node:
        d = 1 + max((depth.get(t, 0) for t in node.input if t), default=0)
        for out in node.output:
            depth[out] = d
    return depth


def _residual_shortcut(node: onnx.NodeProto, producers: Mapping[str, onnx.NodeProto], producer_names: Mapping[str, str],
                       readers: Mapping[str, list[onnx.NodeProto]], depth: Mapping[str, int],
                       constants: Mapping[str, Any], graph_outputs: set[str]) -> tuple[int, str] | None:
    """(index of the shortcut input, name of the node the add fuses into), or None if not a residual add.

    The fused input must come straight from a producer of the add rule's ``fuses_into`` types (a Conv)
    that feeds nothing else: TensorRT can only fold the add into the conv's epilogue when the conv output
    has no other reader. When both inputs come from convs (a downsampling block with a 1x1 conv on the
    shortcut), the deeper one is the main branch, as ModelOpt's longest-path rule decides.
    """
    rule = PLACEMENT.get(node.op_type)
    if rule is None or rule.kind != "residual" or len(node.input) != 2:
        return None
    fusible = rule.fuses_into
    a, b = node.input
    if a == b or a in constants or b in constants or not a or not b:
        return None
    mains = [i for i, t in enumerate((a, b))
             if t in producers and producers[t].op_type in fusible and len(readers.get(t, ())) == 1
             and t not in graph_outputs]
    if not mains:
        return None
    main = max(mains, key=lambda i: depth.get(node.input[i], 0))  # ties: input 0, max keeps the first
    return 1 - main, producer_names[node.input[main]]


def _plan(graph: onnx.GraphProto, policy: QdqPolicy, amax: Mapping[str, float] | None) -> _Plan:
    """Decide the Q/DQ placement. ``amax`` None: assume every activation will have one."""
    names = node_names(graph)
    constants = _constants(graph)
    unknown = sorted(policy.exclude_nodes - set(names))
    if unknown:
        log.warning("QdqPolicy.exclude_nodes names %d node(s) not in this graph: %s", len(unknown),
                    ", ".join(unknown[:10]))

    def excluded(node: onnx.NodeProto, name: str) -> str:
        rule = PLACEMENT.get(node.op_type)
        if policy.precision == "fp8" and rule is not None and not rule.fp8:
            return f"not in FP8: {rule.not_fp8}"
        if name in policy.exclude_nodes:
            return "excluded by policy.exclude_nodes (kept in higher precision)"
        if node.op_type in policy.exclude_op_types:
            return f"op type {node.op_type} excluded by policy.exclude_op_types"
        return ""

    readers: dict[str, list[onnx.NodeProto]] = {}  # the nodes that read each tensor, each node once
    for node in graph.node:
        for t in dict.fromkeys(node.input):
            readers.setdefault(t, []).append(node)
    graph_outputs = {o.name for o in graph.output}
    inputs: dict[str, tuple[_QuantizedInput, ...]] = {}
    skipped: dict[str, str] = {}
    for node, name in zip(graph.node, names):
        rule = PLACEMENT.get(node.op_type)
        if rule is None or rule.kind != "weighted":
            continue
        reason = excluded(node, name)
        planned: tuple[_QuantizedInput, ...] = ()
        if not reason and rule.head_through and not policy.quantize_output_layer \
                and _head(node, rule.head_through, readers, graph_outputs):
            reason = "output layer (feeds a graph output) kept in higher precision (policy.quantize_output_layer)"
        if not reason:
            planned, reason = _weighted_inputs(node, rule, constants, policy)
        if planned:
            inputs[name] = planned
        else:
            skipped[name] = reason

    producers = {out: node for node in graph.node for out in node.output}
    producer_names = {out: name for node, name in zip(graph.node, names) for out in node.output}
    depth = _depths(graph)
    for node, name in zip(graph.node, names):
        found = _residual_shortcut(node, producers, producer_names, readers, depth, constants, graph_outputs)
        if found is None:
            continue
        index, fused_into = found
        shortcut = node.input[index]
        reason = excluded(node, name)
        if not reason and not policy.quantize_residual_add:
            reason = "residual add left unquantized (policy.quantize_residual_add is False)"
        if not reason and fused_into not in inputs:
            reason = f"the conv it would fuse into, {fused_into}, stays in higher precision"
        if not reason and amax is not None and shortcut not in amax:
            reason = f"no amax for shortcut input {shortcut}; the add is left unfused"
            log.warning("residual add %s: %s", name, reason)
        if reason:
            skipped[name] = reason
        else:
            inputs[name] = (_QuantizedInput(index, shortcut),)

    for node, name in zip(graph.node, names):  # pooling after a quantized layer
        rule = PLACEMENT.get(node.op_type)
        if rule is None or rule.kind != "pool" or not node.input or node.input[0] in constants:
            continue
        source = producers.get(node.input[0])
        while source is not None and source.op_type in rule.source_through and source.input:
            source = producers.get(source.input[0])
        quantized_source = source is not None and producer_names[source.output[0]] in inputs
        reason = excluded(node, name)
        if not reason and not quantized_source:
            reason = "its input does not come from a quantized layer: INT8 pooling would add a Q/DQ, not save one"
        if reason:
            skipped[name] = reason
        else:
            inputs[name] = (_QuantizedInput(0, node.input[0]),)

    wanted = {q.tensor for qs in inputs.values() for q in qs if not q.is_weight}
    shared: list[tuple[str, ...]] = []
    for node, name in zip(graph.node, names):  # concatenation of quantized tensors: one scale for all
        rule = PLACEMENT.get(node.op_type)
        if rule is None or rule.kind != "concat" or not node.output or node.output[0] not in wanted:
            continue
        reason = excluded(node, name)
        if not reason and any(t in constants or not t for t in node.input):
            reason = "a constant input: its values would set the shared scale"
        if reason:
            skipped[name] = reason
            continue
        inputs[name] = tuple(_QuantizedInput(i, t) for i, t in enumerate(node.input))
        shared.append(tuple(dict.fromkeys([*node.input, node.output[0]])))
        wanted.update(node.input)

    produced = [i.name for i in graph.input] + [out for node in graph.node for out in node.output]
    activations = list(dict.fromkeys(t for t in produced if t in wanted))
    ordered = {name: inputs[name] for name in names if name in inputs}
    return _Plan(ordered, skipped, activations, _scale_groups(shared))


def _scale_groups(shared: list[tuple[str, ...]]) -> dict[str, frozenset[str]]:
    """Tensor -> every tensor that must share its scale (concats that chain merge into one group)."""
    groups: dict[str, frozenset[str]] = {}
    for members in shared:
        group = frozenset(members).union(*(groups.get(t, frozenset()) for t in members))
        for t in group:
            groups[t] = group
    return groups


def tensors_to_calibrate(model: onnx.ModelProto, policy: QdqPolicy | None = None) -> list[str]:
    """Activation tensors that need an amax: non-constant inputs of the nodes that would get Q/DQ.

    In the order the graph produces them (graph inputs first), without duplicates; residual
    shortcuts are included. Only these need to be exposed by the statistics collector.
    """
    return _plan(model.graph, policy or QdqPolicy(), None).activations


def quantizable_nodes(model: onnx.ModelProto, policy: QdqPolicy | None = None) -> list[str]:
    """Names of the nodes that would get Q/DQ under ``policy``, in graph order (residual adds included).

    The accuracy gate picks from these the layers to keep in higher precision. Unnamed nodes
    are called ``<op_type>_<index>``.
    """
    return list(_plan(model.graph, policy or QdqPolicy(), None).inputs)


def placement(model: onnx.ModelProto, policy: QdqPolicy | None = None) -> tuple[list[str], dict[str, str]]:
    """The nodes that would get Q/DQ under ``policy`` (graph order) and, for the others ``PLACEMENT`` has a rule
    for, why not (a head, too few channels, a weight that is not a constant, an exclusion)."""
    plan = _plan(model.graph, policy or QdqPolicy(), None)
    return list(plan.inputs), dict(plan.skipped)


def _check_amax(plan: _Plan, amax: Mapping[str, float]) -> dict[str, float]:
    missing = [t for t in plan.activations if t not in amax]
    if missing:
        raise ValueError(f"no amax for {len(missing)} tensor(s) of nodes to quantize: {', '.join(missing)} "
                         "(calibrate the tensors that tensors_to_calibrate() lists)")
    values = {t: float(amax[t]) for t in plan.activations}
    bad = [f"{t}={v!r}" for t, v in values.items() if not np.isfinite(v) or v < 0]
    if bad:
        raise ValueError(f"amax must be finite and >= 0: {', '.join(bad)}")
    for t, group in plan.scale_groups.items():  # a concat's inputs and output: the widest range for all
        values[t] = max(values[m] for m in group)
    return values


def _subgraph_inputs(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name read by a node of ``graph`` or of any nested subgraph."""
    read: set[str] = set()
    for node in graph.node:
        read.update(node.input)
        for a in node.attribute:
            for sub in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                read |= _subgraph_inputs(sub)
    return read


def qdq_model_from(model: onnx.ModelProto, amax: Mapping[str, float],
                   policy: QdqPolicy | None = None) -> tuple[onnx.ModelProto, QdqReport]:
    """A new model with INT8 Q/DQ inserted as TensorRT recommends, and a report of what was done.

    ``amax`` maps activation tensor names to the calibrated absolute maximum (same units as the
    tensor); every tensor :func:`tensors_to_calibrate` lists must be there, except residual
    shortcuts, whose add is then left unquantized. Weights must be loaded, or left in their file by
    ``compiler.core.onnx_io.load_onnx_by_reference`` (then only the INT8 weights are held in memory, and the
    FP32 ones that stay are references). The input model is not modified. Raises ValueError for missing or
    non-finite amax values.
    """
    policy = policy or QdqPolicy()
    fp8 = policy.precision == "fp8"
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset < _MIN_OPSET[policy.precision]:
        raise ValueError(f"{policy.precision.upper()} Q/DQ needs opset >= {_MIN_OPSET[policy.precision]}; this model "
                         f"has opset {opset} (calibration.weights.raise_opset raises it)")
    plan = _plan(model.graph, policy, amax)
    amax_values = _check_amax(plan, amax)

    # built field by field rather than as a copy of ``model``: a copy would hold every FP32 weight once more,
    # although the INT8 ones replace most of them (and protobuf keeps removed messages' bytes until the end)
    out = copy_fields(model, onnx.ModelProto(), skip={"graph"})
    out.ir_version = min(out.ir_version, MAX_IR_VERSION)
    source = model.graph
    graph = copy_fields(source, out.graph, skip={"node", "initializer"})
    fresh = FreshNames(source)
    constants = _constants(source)
    new_inits: list[onnx.TensorProto] = []

    def scale_and_zero(base: str, scale: np.ndarray) -> tuple[str, str]:
        scale_name, zero_name = fresh(f"{base}_scale"), fresh(f"{base}_zero_point")
        new_inits.append(numpy_helper.from_array(scale.astype(np.float32), scale_name))
        new_inits.append(numpy_helper.from_array(np.zeros(scale.shape, dtype=FP8 if fp8 else np.int8), zero_name))
        return scale_name, zero_name

    # One Q->DQ pair per activation tensor, placed right after its producer.
    dequantized: dict[str, str] = {}
    pair_nodes: dict[str, list[onnx.NodeProto]] = {}
    for t in plan.activations:
        scale = scale_for(np.array(amax_values[t], dtype=np.float32), FP8_MAX if fp8 else INT8_MAX)
        scale_name, zero_name = scale_and_zero(t, scale)
        q_out, dq_out = fresh(f"{t}_quantized"), fresh(f"{t}_dequantized")
        pair_nodes[t] = [
            helper.make_node("QuantizeLinear", [t, scale_name, zero_name], [q_out], name=fresh(f"{t}_Quantize")),
            helper.make_node("DequantizeLinear", [q_out, scale_name, zero_name], [dq_out],
                             name=fresh(f"{t}_Dequantize")),
        ]
        dequantized[t] = dq_out

    # One INT8 initializer + DQ per (weight, axis), placed before its first consumer.
    weight_dq: dict[tuple[str, int | None], tuple[str, onnx.NodeProto]] = {}
    for planned in plan.inputs.values():
        for q in planned:
            if not q.is_weight or (q.tensor, q.axis) in weight_dq:
                continue
            # read from its file when the model was loaded by reference; raises for weights never loaded
            quantize = fp8_weight if fp8 else int8_weight
            q_weight, scale = quantize(tensor_array(constants[q.tensor]), q.axis)
            int8_name = fresh(f"{q.tensor}_quantized")
            new_inits.append(numpy_helper.from_array(q_weight, int8_name))
            scale_name, zero_name = scale_and_zero(q.tensor, scale)
            dq_out = fresh(f"{q.tensor}_dequantized")
            dq = helper.make_node("DequantizeLinear", [int8_name, scale_name, zero_name], [dq_out],
                                  name=fresh(f"{q.tensor}_Dequantize"))
            if q.axis is not None:
                dq.attribute.append(helper.make_attribute("axis", q.axis))
            weight_dq[(q.tensor, q.axis)] = (dq_out, dq)

    nodes: list[onnx.NodeProto] = []
    for i in source.input:
        nodes += pair_nodes.get(i.name, [])
    emitted: set[tuple[str, int | None]] = set()
    for original, name in zip(source.node, node_names(source)):
        node = onnx.NodeProto()
        node.CopyFrom(original)
        for q in plan.inputs.get(name, ()):
            if q.is_weight:
                key = (q.tensor, q.axis)
                if key not in emitted:
                    nodes.append(weight_dq[key][1])
                    emitted.add(key)
                node.input[q.index] = weight_dq[key][0]
            else:
                node.input[q.index] = dequantized[q.tensor]
        nodes.append(node)
        for t in node.output:
            nodes += pair_nodes.get(t, [])
    graph.node.extend(nodes)

    # FP32 weights now read by nobody are left out: the INT8 copy replaces them.
    read = _subgraph_inputs(graph) | {o.name for o in graph.output}
    replaced = {tensor for tensor, _ in weight_dq}
    graph.initializer.extend(t for t in source.initializer if t.name in read or t.name not in replaced)
    graph.initializer.extend(new_inits)

    report = QdqReport(quantized_nodes=list(plan.inputs), skipped_nodes=dict(plan.skipped),
                       qdq_pairs=len(plan.activations), quantized_weights=len(weight_dq))
    log.debug("INT8 Q/DQ: %d nodes quantized, %d activation Q/DQ pairs, %d INT8 weights, %d nodes kept in higher "
             "precision", len(report.quantized_nodes), report.qdq_pairs, report.quantized_weights,
             len(report.skipped_nodes))
    for name, reason in plan.skipped.items():
        log.debug("no Q/DQ on %s: %s", name, reason)
    return out, report

