"""FP16 ONNX graphs for TensorRT's strongly typed mode: FP16 weights and Cast nodes written into the graph.

TensorRT 11 has no FP16 builder flag; a layer runs in the types its ONNX tensors carry. ``fp16_model_from``
rewrites an FP32 graph so that float computation runs in FP16, except nodes kept in FP32 for one of these
reasons, checked in this order and reported in ``Fp16Report.fp32_nodes``:

1. named, or of an op type named, in ``Fp16Policy.keep_fp32`` (``--keep-fp32``);
2. an op type in ``Fp16Policy.fp32_ops`` (by default ``FP32_OPS``, in ``calibration/fp16_policy.py``);
3. an op whose ONNX schema has no float16 at the model's opset (float ``Range``), or no ONNX schema at all
   (custom domains, model-local functions), or that feeds a control-flow subgraph;
4. data: it produces or consumes a tensor whose observed max |x| (``max_abs``, from calibration data,
   keyed by tensor name) exceeds ``Fp16Policy.overflow_threshold``, as ModelOpt AutoCast's I/O range rule,
   or is not zero but below ``Fp16Policy.underflow_threshold`` (FP16's smallest normal, 6.1e-5): every value of
   such a tensor would be an FP16 subnormal of a few bits, or zero below 6e-8 (a head whose outputs are 1e-22
   comes out of FP16 all zero).

A Cast is inserted at every FP32<->FP16 boundary, one per tensor and direction, shared by its consumers.
Float initializers and Constant nodes are converted (or duplicated, when FP32 and FP16 nodes share them)
rather than cast at run time. Integer and bool tensors, and so shape computations, are not touched;
``Shape`` and ``Size`` read only shapes and take a float tensor in whichever type it has.

Not done: control-flow subgraphs stay FP32; underflow is judged by a tensor's largest value only (a tensor
with some values below 6.1e-5 and others above stays FP16); weights smaller than FP16's smallest subnormal,
6e-8, become that subnormal rather than 0, keeping their sign.
"""

# Own code, not onnxconverter-common 1.16: on our transformer export it retypes Cast(to=FLOAT)'s output to
# FP16 without changing `to` (checker and ORT reject the graph) and has no data-driven range check; ModelOpt
# AutoCast has one but brings nvidia-modelopt's heavy dependency tree for a few hundred lines of graph work.

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from calibration.fp16_policy import FP16_MAX, FP16_MIN_NORMAL, FP16_TINY, FP32_OPS, Fp16Policy
from compiler.core.onnx_io import MAX_IR_VERSION, copy_fields, outer_scope_names, tensor_array, weightless_copy

__all__ = ["Fp16Report", "float_tensors", "fp16_model_from", "int8_fp16_model_from"]

log = logging.getLogger(__name__)

FLOAT = TensorProto.FLOAT
FLOAT16 = TensorProto.FLOAT16
QDQ_NODE_TYPES = frozenset({"QuantizeLinear", "DequantizeLinear"})

# Ops that read only the shape of a float input: they never need a Cast.
_SHAPE_ONLY_OPS = frozenset({"Shape", "Size"})
# Ops whose float output type is set by an attribute that `_retarget` knows how to switch to FP16.
_DTYPE_ATTR_OPS = frozenset({"Cast", "ConstantOfShape", "EyeLike", "RandomNormal", "RandomNormalLike",
                             "RandomUniform", "RandomUniformLike", "Bernoulli"})
# (op, output index) whose float type is fixed by an attribute left as it is (stash_type=1: FP32 statistics).
_FIXED_FP32_OUTPUTS = frozenset({("LayerNormalization", 1), ("LayerNormalization", 2)})
_Formal = onnx.defs.OpSchema.FormalParameter


@dataclass
class Fp16Report:
    """What ``fp16_model_from`` did. ``fp16_nodes`` counts compute nodes (not Constants) now in FP16."""

    fp32_nodes: dict[str, str] = field(default_factory=dict)  # node name -> reason
    fp16_nodes: int = 0
    fp16_node_names: list[str] = field(default_factory=list)
    casts_inserted: int = 0
    clipped_initializers: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fp16_model_from(model: onnx.ModelProto, policy: Fp16Policy | None = None,
                    max_abs: dict[str, float] | None = None) -> tuple[onnx.ModelProto, Fp16Report]:
    """A new model in which float computation runs in FP16 except the nodes ``policy`` keeps in FP32.

    ``max_abs`` maps tensor names of ``model`` to their max |x| over calibration data; without it only the
    type rules apply. Initializers feeding FP16 nodes are clipped to +-65504 (listed in the report; a mask
    fill of finfo(float32).min becomes -65504, which still gives exp() == 0). ``model`` is not modified and
    must have its weights loaded. Raises ValueError naming the node when a node's float output type cannot
    be switched to FP16 (keep it in FP32 with ``keep_fp32``), or if the result fails strict type inference.
    """
    policy = policy or Fp16Policy()
    max_abs = max_abs or {}
    typed = onnx.shape_inference.infer_shapes(weightless_copy(model))
    plan = _Plan(model, typed, policy, max_abs)
    plan.decide()
    out = _Rewriter(plan).model()
    _check_types(out)
    report = plan.report
    log.debug("FP16: %d nodes in FP16, %d kept in FP32, %d Casts inserted, %d constants clipped", report.fp16_nodes,
             len(report.fp32_nodes), report.casts_inserted, len(report.clipped_initializers))
    return out, report


def int8_fp16_model_from(qdq_model: onnx.ModelProto, policy: Fp16Policy | None = None,
                         max_abs: dict[str, float] | None = None) -> tuple[onnx.ModelProto, Fp16Report]:
    """INT8 where ``qdq_model`` has Q/DQ, FP16 for the rest: ModelOpt's ``high_precision_dtype="fp16"``.

    ``qdq_model`` comes from ``calibration.qdq.qdq_model_from``; the float region then goes through
    :func:`fp16_model_from` with the same data-driven FP32 keeps (``max_abs`` of the FP32 model's tensors,
    ``FP32_OPS``, ``policy.keep_fp32``). Q/DQ nodes take FP16 scales where the opset allows it (>= 19), so
    TensorRT sees FP16 on both sides of every INT8 layer; a Q/DQ whose scale is below FP16's smallest normal
    number (6.1e-5, an amax under 0.0078) would lose scale bits as a subnormal and stays FP32 behind Casts.
    Graph inputs and outputs keep their types.
    """
    policy = policy or Fp16Policy()
    constants = {t.name: t for t in qdq_model.graph.initializer}
    tiny = set()
    for node in qdq_model.graph.node:
        if node.op_type in QDQ_NODE_TYPES and len(node.input) > 1 and node.input[1] in constants:
            scale = tensor_array(constants[node.input[1]])
            if scale.size and float(np.min(np.abs(scale))) < FP16_MIN_NORMAL:
                tiny.add(node.name)
    if tiny:
        log.info("%d Q/DQ node(s) keep FP32 scales: a scale below %.3g is subnormal in FP16", len(tiny),
                 FP16_MIN_NORMAL)
    keep = dataclasses.replace(policy, keep_fp32=policy.keep_fp32 | tiny)
    return fp16_model_from(qdq_model, keep, max_abs)


def float_tensors(model: onnx.ModelProto) -> list[str]:
    """The FLOAT tensors ``model``'s nodes compute, in graph order: those whose max |x| the range rule reads.

    Types come from shape inference on the graph alone (no copy of the weights, no 2 GiB limit); a tensor
    whose type it cannot infer is left out.
    """
    typed = onnx.shape_inference.infer_shapes(weightless_copy(model))
    floats = {vi.name for vi in list(typed.graph.value_info) + list(typed.graph.output)
              if vi.type.tensor_type.elem_type == onnx.TensorProto.FLOAT}
    return [o for n in model.graph.node for o in n.output if o in floats]


@dataclass
class _NodeInfo:
    index: int
    node: onnx.NodeProto
    name: str
    float_in: list[int]  # input slots holding FLOAT tensors
    float_out: list[int]
    fixed_in: set[int] = field(default_factory=set)  # slots whose schema type is literally tensor(float)
    fixed_out: set[int] = field(default_factory=set)
    stuck_output: str = ""  # a FLOAT output whose type comes from an attribute `_retarget` cannot switch
    fp16: bool | None = None  # None: not a float compute node (no float tensor, Shape, Constant)


class _Plan:
    """Decides the precision of every node and the name of every version of every float tensor."""

    def __init__(self, model: onnx.ModelProto, typed: onnx.ModelProto, policy: Fp16Policy,
                 max_abs: dict[str, float]) -> None:
        self.model, self.policy, self.max_abs = model, policy, max_abs
        self.report = Fp16Report()
        graph = model.graph
        self.value_infos: dict[str, onnx.ValueInfoProto] = {}
        for vi in [*typed.graph.input, *typed.graph.output, *typed.graph.value_info]:
            self.value_infos.setdefault(vi.name, vi)
        self.types = {name: vi.type.tensor_type.elem_type for name, vi in self.value_infos.items()
                      if vi.type.HasField("tensor_type")}
        for t in graph.initializer:
            self.types[t.name] = t.data_type
        for s in graph.sparse_initializer:
            self.types[s.values.name] = s.values.data_type
        self.opsets = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
        self.input_names = [i.name for i in graph.input]
        self.output_names = [o.name for o in graph.output]
        self.initializers = {t.name: t for t in graph.initializer if t.name not in set(self.input_names)}
        # referenced from a subgraph: must stay FP32 under its name
        self.pinned = {name for node in graph.node for name in outer_scope_names(node)}
        self.nodes = [self._info(i, n) for i, n in enumerate(graph.node)]
        # float Constant nodes are converted like initializers (unless named in --keep-fp32)
        self.constant_nodes = {info.node.output[0]: info.node for info in self.nodes
                               if info.node.op_type == "Constant" and _is_onnx(info.node) and info.float_out
                               and info.node.name not in policy.keep_fp32}
        self.consumers: dict[str, list[tuple[_NodeInfo, int]]] = defaultdict(list)
        for info in self.nodes:
            for j in info.float_in:
                self.consumers[info.node.input[j]].append((info, j))
        # filled by decide()
        self.home: dict[str, int] = {}  # non-constant float tensor -> the type it is produced in
        self.names: dict[str, dict[int, str]] = {}  # float tensor -> {type: name of that version}
        self.output_types: dict[str, int] = {}
        self._taken: set[str] = set()  # every tensor name in use, for fresh ones

    def _info(self, index: int, node: onnx.NodeProto) -> _NodeInfo:
        float_in = [j for j, name in enumerate(node.input) if name and self._is_float(name, node)]
        float_out = [j for j, name in enumerate(node.output) if name and self._is_float(name, node)]
        name = node.name or f"{node.op_type}_{index}"
        return _NodeInfo(index, node, name, float_in, float_out)

    def _is_float(self, tensor: str, node: onnx.NodeProto) -> bool:
        if tensor not in self.types:
            raise ValueError(f"node {node.name!r} ({node.op_type}): the element type of {tensor!r} is unknown "
                             "even after ONNX shape inference; fp16_model_from needs every tensor typed")
        return self.types[tensor] == FLOAT

    # -- decisions --------------------------------------------------------------------------------------------

    def decide(self) -> None:
        self._warn_unmatched()
        sources = []
        for info in self.nodes:
            op = info.node.op_type
            if not info.float_in and not info.float_out:
                continue
            if info.node.output[0] in self.constant_nodes or (op in _SHAPE_ONLY_OPS and not info.float_out):
                continue
            reason = self._fp32_reason(info)
            if reason is None and not info.float_in:
                sources.append(info)  # Cast from int, ConstantOfShape...: decided by their consumers below
                continue
            self._set(info, reason)
        for info in sources:
            self._set(info, None if self._feeds_fp16(info) else "its float output feeds only FP32 nodes")
        self._plan_names()

    def _set(self, info: _NodeInfo, reason: str | None) -> None:
        info.fp16 = reason is None
        if reason is None:
            if info.stuck_output:
                raise ValueError(f"node {info.name!r} ({info.node.op_type}): the FLOAT type of its output "
                                 f"{info.stuck_output!r} is set by an attribute fp16_model_from cannot switch to "
                                 f"FP16; keep it in FP32 with --keep-fp32 {info.node.op_type}")
            self.report.fp16_nodes += 1
            self.report.fp16_node_names.append(info.name)
            return
        self.report.fp32_nodes[info.name] = reason
        log.debug("kept %s %s in FP32: %s", info.node.op_type, info.name, reason)

    def _fp32_reason(self, info: _NodeInfo) -> str | None:
        node, policy = info.node, self.policy
        if node.name in policy.keep_fp32 or node.op_type in policy.keep_fp32:
            return "--keep-fp32"
        if node.op_type in policy.fp32_ops and _is_onnx(node):
            why = FP32_OPS.get(node.op_type)
            return f"op type {node.op_type} in FP32_OPS" + (f" ({why})" if why else "")
        reason = self._schema_reason(info)
        if reason:
            return reason
        pinned = [node.output[j] for j in info.float_out if node.output[j] in self.pinned]
        if pinned:
            return f"produces {pinned[0]}, which a control-flow subgraph reads"
        return self._range_reason(info)

    def _schema_reason(self, info: _NodeInfo) -> str | None:
        """Why the schema rules out FP16; also records the slots typed literally tensor(float)."""
        node = info.node
        domain = "" if node.domain == "ai.onnx" else node.domain
        version = self.opsets.get(domain)
        try:
            schema = onnx.defs.get_schema(node.op_type, version or 1, domain)
        except onnx.defs.SchemaError:
            return f"no ONNX schema for {domain or 'ai.onnx'}::{node.op_type} at opset {version}: left as exported"
        constraints = {c.type_param_str: c.allowed_type_strs for c in schema.type_constraints}
        bound = set()
        for is_input, params, slots, fixed in ((True, schema.inputs, info.float_in, info.fixed_in),
                                               (False, schema.outputs, info.float_out, info.fixed_out)):
            for j in slots:
                param = _formal(params, j)
                if param is None:
                    return f"{node.op_type} has no formal parameter for slot {j} at opset {version}"
                if param.type_str not in constraints:
                    fixed.add(j)  # a literal tensor(float): this slot stays FP32 in an FP16 node
                elif "tensor(float16)" not in constraints[param.type_str]:
                    return f"opset {version} {node.op_type} does not accept float16 for {param.type_str}"
                elif is_input:
                    bound.add(param.type_str)
        for j in info.float_out:
            param = _formal(schema.outputs, j)
            if j in info.fixed_out or param is None or param.type_str in bound:
                continue
            if (node.op_type, j) in _FIXED_FP32_OUTPUTS:
                info.fixed_out.add(j)
            elif node.op_type not in _DTYPE_ATTR_OPS:
                info.stuck_output = node.output[j]
        return None

    def _range_reason(self, info: _NodeInfo) -> str | None:
        if not self.max_abs:
            return None
        thr, low = self.policy.overflow_threshold, self.policy.underflow_threshold
        node = info.node
        for verb, names in (("produces", [node.output[j] for j in info.float_out]),
                            ("consumes", [node.input[j] for j in info.float_in])):
            for name in names:
                value = self.max_abs.get(name)
                if name in self.initializers or name in self.constant_nodes or value is None:
                    continue
                if not value <= thr:  # NaN and inf count as out of range
                    return f"{verb} {name} with max |x| {value:.3g} > {thr:g}"
                if 0 < value < low:
                    return (f"{verb} {name} with max |x| {value:.3g}, below FP16's smallest normal "
                            f"{FP16_MIN_NORMAL:.2g} (subnormal in FP16, zero below {FP16_TINY:.2g})")
        return None

    def _feeds_fp16(self, info: _NodeInfo) -> bool:
        for j in info.float_out:
            tensor = info.node.output[j]
            if tensor in self.pinned or (tensor in self.output_names and self._output_type(tensor) == FLOAT):
                return False
            for consumer, k in self.consumers.get(tensor, []):
                if self._in_type(consumer, k) == FLOAT:
                    return False
        return any(self.consumers.get(info.node.output[j]) for j in info.float_out)

    def _in_type(self, info: _NodeInfo, slot: int) -> int | None:
        """The type a node reads from a float input slot; None where any type will do."""
        if info.fp16 is None:
            return None if info.node.op_type in _SHAPE_ONLY_OPS else FLOAT
        return FLOAT16 if info.fp16 and slot not in info.fixed_in else FLOAT

    def _out_type(self, info: _NodeInfo, slot: int) -> int:
        return FLOAT16 if info.fp16 and slot not in info.fixed_out else FLOAT

    def _output_type(self, name: str) -> int:
        """The type a float graph output gets: FP32 with keep_io_types, if it overflows FP16, or if pinned."""
        value = self.max_abs.get(name, 0.0)
        if self.policy.keep_io_types or name in self.pinned or not value <= self.policy.overflow_threshold:
            return FLOAT
        return FLOAT16

    def _warn_unmatched(self) -> None:
        known = {n.name for n in self.model.graph.node} | {n.op_type for n in self.model.graph.node}
        for entry in sorted(self.policy.keep_fp32 - known):
            log.warning("--keep-fp32 %s matches no node name or op type in this graph", entry)
        if self.max_abs and not set(self.max_abs) & set(self.types):
            log.warning("max_abs names none of this graph's tensors; was it collected on another model?")

    # -- names ------------------------------------------------------------------------------------------------

    def _plan_names(self) -> None:
        graph = self.model.graph
        self._taken = {n for node in graph.node for n in [*node.input, *node.output]} | set(self.types)
        outputs = set(self.output_names)
        overridable = {t.name for t in graph.initializer}  # an initializer that is also an input stays FP32
        for name in self.input_names:
            if self.types.get(name) == FLOAT:
                keep = (self.policy.keep_io_types or name in self.pinned or name in overridable
                        or not self.max_abs.get(name, 0.0) <= self.policy.overflow_threshold)
                self.home[name] = FLOAT if keep else FLOAT16
        for s in graph.sparse_initializer:
            if s.values.data_type == FLOAT:
                self.home[s.values.name] = FLOAT
        for info in self.nodes:
            if info.fp16 is not None:
                for j in info.float_out:
                    self.home[info.node.output[j]] = self._out_type(info, j)
        for name in self.output_names:
            if self.types.get(name) == FLOAT:
                home = self.home.get(name)
                is_input = name in self.input_names
                self.output_types[name] = home if is_input and home is not None else self._output_type(name)
        for name, home in self.home.items():
            self.names[name] = {home: name}
            wanted = self.output_types.get(name, home)
            if name in outputs and wanted != home:
                self.names[name] = {home: self._fresh(name, home), wanted: name}
        for name in [*self.initializers, *self.constant_nodes]:
            if self.types.get(name) != FLOAT:
                continue
            needed = {t for t in (self._in_type(c, k) for c, k in self.consumers.get(name, [])) if t is not None}
            if name in self.pinned:
                needed.add(FLOAT)
            first = self.output_types.get(name, FLOAT if FLOAT in needed or not needed else FLOAT16)
            self.names[name] = {first: name} | {t: self._fresh(name, t) for t in needed - {first}}

    def _fresh(self, base: str, dtype: int) -> str:
        stem = f"{base}_{'fp16' if dtype == FLOAT16 else 'fp32'}"
        name, i = stem, 1
        while name in self._taken:
            name, i = f"{stem}_{i}", i + 1
        self._taken.add(name)
        return name


class _Rewriter:
    """Writes the planned model: nodes in order, Casts before their first consumer, converted constants."""

    def __init__(self, plan: _Plan) -> None:
        self.plan = plan
        self.nodes: list[onnx.NodeProto] = []
        self.made: set[tuple[str, int]] = set()  # (tensor, type) versions already produced
        self.origin: dict[str, tuple[str, int | None]] = {}  # new tensor name -> (original name, type)
        self.node_names = {n.name for n in plan.model.graph.node if n.name}

    def model(self) -> onnx.ModelProto:
        plan, graph = self.plan, self.plan.model.graph
        for name, versions in plan.names.items():
            if name in plan.home:
                self.made.add((name, plan.home[name]))
            else:  # constants: every version is written as data
                self.made.update((name, dtype) for dtype in versions)
        for info in plan.nodes:
            self._emit(info)
        for name in plan.output_names:
            if name in plan.output_types:
                self._version(name, plan.output_types[name])
        initializers = list(self._initializers())
        clipped = plan.report.clipped_initializers
        if clipped:
            log.warning("clipped %d FP16 constants to +-%g: %s (keep their consumers in FP32 with --keep-fp32 "
                        "if these are real weights, not mask fills)", len(clipped), FP16_MAX, ", ".join(clipped))
        out = copy_fields(plan.model, onnx.ModelProto(), skip={"graph"})
        out.ir_version = min(out.ir_version, MAX_IR_VERSION)
        g = copy_fields(graph, out.graph, skip={"node", "initializer", "input", "output", "value_info"})
        g.node.extend(self.nodes)
        g.initializer.extend(initializers)
        for vi in graph.input:
            g.input.append(self._retyped(vi, plan.home.get(vi.name)))
        for vi in graph.output:
            g.output.append(self._retyped(vi, plan.output_types.get(vi.name)))
        io = {vi.name for vi in [*g.input, *g.output]} | {t.name for t in g.initializer}
        g.value_info.extend(self._value_infos(io))
        return out

    def _emit(self, info: _NodeInfo) -> None:
        plan, node = self.plan, info.node
        if node.op_type == "Constant" and node.output[0] in plan.constant_nodes:
            self._emit_constant(node)
            return
        new = onnx.NodeProto()
        new.CopyFrom(node)
        for j in info.float_in:
            wanted = plan._in_type(info, j)
            source = node.input[j]
            # Shape and Size take whichever version exists; the first one listed is always written
            new.input[j] = self._version(source, wanted) if wanted else next(iter(plan.names[source].values()))
        for j in info.float_out:
            tensor = node.output[j]
            home = plan.home[tensor]
            new.output[j] = plan.names[tensor][home]
            self.origin[new.output[j]] = (tensor, home)
        for tensor in node.output:
            self.origin.setdefault(tensor, (tensor, None))
        if info.fp16 and info.float_out and node.op_type in _DTYPE_ATTR_OPS:
            clipped = _retarget(new)
            if clipped:
                plan.report.clipped_initializers.append(f"{info.name}/value")
        self.nodes.append(new)

    def _version(self, tensor: str, dtype: int) -> str:
        """The name of ``tensor`` in ``dtype``, emitting the Cast that makes it on first use."""
        plan = self.plan
        name = plan.names[tensor].get(dtype)
        if (tensor, dtype) in self.made and name is not None:
            return name
        if tensor not in plan.home:
            raise ValueError(f"fp16_model_from bug: no {onnx.helper.tensor_dtype_to_string(dtype)} version of "
                             f"constant {tensor!r}")
        if name is None:
            name = plan.names[tensor][dtype] = plan._fresh(tensor, dtype)
        source = plan.names[tensor][plan.home[tensor]]
        cast_name = self._node_name(f"{name}_cast")
        self.nodes.append(helper.make_node("Cast", [source], [name], name=cast_name, to=dtype))
        self.made.add((tensor, dtype))
        self.origin[name] = (tensor, dtype)
        plan.report.casts_inserted += 1
        return name

    def _emit_constant(self, node: onnx.NodeProto) -> None:
        tensor = node.output[0]
        for dtype, name in self.plan.names[tensor].items():
            new = onnx.NodeProto()
            new.CopyFrom(node)
            new.output[0] = name
            if name != tensor:
                new.name = self._node_name(f"{node.name or 'Constant'}_{'fp16' if dtype == FLOAT16 else 'fp32'}")
            if dtype == FLOAT16:
                value = _constant_value(node)
                converted, clipped = _to_fp16(value, "")
                del new.attribute[:]
                new.attribute.append(helper.make_attribute("value", converted))
                if clipped:
                    self.plan.report.clipped_initializers.append(node.name or tensor)
            self.origin[name] = (tensor, dtype)
            self.nodes.append(new)

    def _initializers(self) -> Iterator[TensorProto]:
        plan = self.plan
        for t in plan.model.graph.initializer:
            if t.name not in plan.initializers or t.data_type != FLOAT:
                yield t
                continue
            for dtype, name in plan.names[t.name].items():
                if dtype == FLOAT:
                    copy = TensorProto()
                    copy.CopyFrom(t)
                    copy.name = name
                    yield copy
                    continue
                converted, clipped = _to_fp16(tensor_array(t), name)  # raises for weights never loaded
                if clipped:
                    plan.report.clipped_initializers.append(t.name)
                yield converted

    def _retyped(self, vi: onnx.ValueInfoProto, dtype: int | None) -> onnx.ValueInfoProto:
        new = onnx.ValueInfoProto()
        new.CopyFrom(vi)
        if dtype is not None and new.type.HasField("tensor_type"):
            new.type.tensor_type.elem_type = dtype
        return new

    def _value_infos(self, io: set[str]) -> Iterator[onnx.ValueInfoProto]:
        for name, (original, dtype) in self.origin.items():
            vi = self.plan.value_infos.get(original)
            if name in io or vi is None:
                continue
            new = self._retyped(vi, dtype)
            new.name = name
            yield new

    def _node_name(self, stem: str) -> str:
        name, i = stem, 1
        while name in self.node_names:
            name, i = f"{stem}_{i}", i + 1
        self.node_names.add(name)
        return name


# -- helpers -----------------------------------------------------------------------------------------------------


def _is_onnx(node: onnx.NodeProto) -> bool:
    return node.domain in ("", "ai.onnx")


def _formal(params: Sequence[_Formal], slot: int) -> _Formal | None:
    if slot < len(params):
        return params[slot]
    if params and params[-1].option == onnx.defs.OpSchema.FormalParameterOption.Variadic:
        return params[-1]
    return None


def _to_fp16(values: np.ndarray, name: str) -> tuple[TensorProto, bool]:
    """``values`` as an FP16 tensor: finite values clipped to +-65504, tiny non-zeros kept non-zero."""
    values = np.asarray(values, dtype=np.float32)
    magnitude = np.abs(values)
    overflow = np.isfinite(values) & (magnitude > FP16_MAX)
    tiny = (magnitude > 0) & (magnitude < FP16_TINY)
    if overflow.any() or tiny.any():
        values = np.where(overflow, np.sign(values) * FP16_MAX, values)
        values = np.where(tiny, np.sign(values) * FP16_TINY, values)
    return numpy_helper.from_array(values.astype(np.float16), name), bool(overflow.any())


def _constant_value(node: onnx.NodeProto) -> np.ndarray:
    for attr in node.attribute:
        if attr.name == "value":
            return numpy_helper.to_array(attr.t)
        if attr.name == "value_float":
            return np.array(attr.f, dtype=np.float32)
        if attr.name == "value_floats":
            return np.array(list(attr.floats), dtype=np.float32)
    raise ValueError(f"Constant {node.name!r}: only value, value_float and value_floats can be converted to FP16; "
                     "keep it in FP32 with --keep-fp32")


def _retarget(node: onnx.NodeProto) -> bool:
    """Switch the attribute that makes ``node``'s output FLOAT to FLOAT16; True if a value had to be clipped."""
    attrs = {a.name: a for a in node.attribute}
    if node.op_type == "Cast":
        if attrs["to"].i == FLOAT:
            attrs["to"].i = FLOAT16
    elif node.op_type == "ConstantOfShape":
        value = numpy_helper.to_array(attrs["value"].t) if "value" in attrs else np.zeros(1, np.float32)
        converted, clipped = _to_fp16(value, "")
        if "value" in attrs:
            node.attribute.remove(attrs["value"])
        node.attribute.append(helper.make_attribute("value", converted))
        return clipped
    elif node.op_type in ("RandomNormal", "RandomUniform") and "dtype" not in attrs:
        node.attribute.append(helper.make_attribute("dtype", FLOAT16))
    elif "dtype" in attrs and attrs["dtype"].i == FLOAT:
        attrs["dtype"].i = FLOAT16
    return False


def _check_types(model: onnx.ModelProto) -> None:
    try:
        onnx.shape_inference.infer_shapes(weightless_copy(model), strict_mode=True)
    except onnx.shape_inference.InferenceError as err:
        raise ValueError(f"fp16_model_from produced inconsistent types ({err}); keep the node it names in FP32 "
                         "with --keep-fp32 and report this") from err
