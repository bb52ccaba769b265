"""FP16 arithmetic emulated in an FP32 graph, so that ONNX Runtime's CPU provider shows what FP16 hardware computes.

The accuracy gate (``calibration/accuracy.py``) runs an FP16 candidate through ``fp16_rounding_emulation``
when it evaluates on the CPU: there an FP16 graph would keep FP32 values from node to node and the gate
would measure nothing. ``calibration/fp16.py`` writes the FP16 graphs themselves.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import AttributeProto, TensorProto, helper, numpy_helper

from compiler.core.onnx_io import copy_fields, outer_scope_names, tensor_array, weightless_copy

__all__ = ["fp16_rounding_emulation"]

FLOAT = TensorProto.FLOAT
FLOAT16 = TensorProto.FLOAT16


def fp16_rounding_emulation(model: onnx.ModelProto) -> onnx.ModelProto:
    """An FP32 graph that computes what the FP16 graph ``model`` computes on FP16 hardware, for CPUs.

    ONNX Runtime's CPU provider has FP16 kernels for few ops: it runs the others in FP32 behind Casts that it
    then removes between consecutive nodes, so an FP16 graph on the CPU keeps FP32 values from node to node
    (no underflow, no overflow) and its gate would measure nothing. Here every FP16 tensor is held in FP32
    but rounded to FP16 (a Cast to FLOAT16 and back, which ONNX Runtime keeps: it is not lossless) right
    after the node that produces it, and FP16 weights become FP32 with the same values. Inside a node the
    arithmetic is FP32, as TensorRT accumulates FP16 convolutions, GEMMs and reductions in FP32; values
    round to nearest even, overflow to +-inf and underflow to subnormals and 0 as FP16 storage does. Graph
    inputs and outputs typed FLOAT16 become FLOAT. A DequantizeLinear of a constant (an INT8 weight) is
    computed here, the weight stored in FP32 with its FP16 rounding. ``model`` is not modified. Will not emulate
    FP16 inside control-flow subgraphs (``fp16_model_from`` leaves them FP32).
    """
    typed = onnx.shape_inference.infer_shapes(weightless_copy(model))
    types = {vi.name: vi.type.tensor_type.elem_type
             for vi in [*typed.graph.input, *typed.graph.output, *typed.graph.value_info]
             if vi.type.HasField("tensor_type")}
    out = copy_fields(model, onnx.ModelProto(), skip={"graph"})
    graph = model.graph
    g = copy_fields(graph, out.graph, skip={"initializer", "node", "value_info", "input", "output"})
    weights = _dequantized_weights(graph, types)
    folded = [n for n in graph.node if n.output and n.output[0] in weights]
    read = {name for n in graph.node if not (n.output and n.output[0] in weights) for name in n.input}
    read |= {name for n in graph.node for name in outer_scope_names(n)}
    read |= {o.name for o in graph.output} | {i.name for i in graph.input}
    only_folded = {name for n in folded for name in n.input} - read
    for t in graph.initializer:
        if t.name in only_folded:
            continue  # read only by the weights' DequantizeLinear, whose result replaces it
        if t.data_type == FLOAT16:
            g.initializer.append(numpy_helper.from_array(tensor_array(t).astype(np.float32), t.name))
        else:
            g.initializer.append(t)
    for field_name in ("input", "output"):
        for vi in getattr(graph, field_name):
            new = getattr(g, field_name).add()
            new.CopyFrom(vi)
            if new.type.tensor_type.elem_type == FLOAT16:
                new.type.tensor_type.elem_type = FLOAT
    for name, node in weights.items():
        _write_dequantized(graph, node, types[name], g)
    taken = {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    for node in graph.node:
        if node.output and node.output[0] in weights:
            continue
        new = g.node.add()
        new.CopyFrom(node)
        _fp32_attributes(new)
        rounded = [(j, name) for j, name in enumerate(node.output) if name and types.get(name) == FLOAT16]
        for j, name in rounded:
            half, stem = f"{name}__fp16", name
            while half in taken:
                stem += "_"
                half = f"{stem}__fp16"
            taken.add(half)
            if node.op_type == "Cast":  # already rounds: only come back to FP32
                new.output[j] = half
                g.node.add().CopyFrom(helper.make_node("Cast", [half], [name], to=FLOAT, name=f"{half}_up"))
                continue
            wide = f"{stem}__fp32"
            taken.add(wide)
            new.output[j] = wide
            g.node.add().CopyFrom(helper.make_node("Cast", [wide], [half], to=FLOAT16, name=f"{half}_round"))
            g.node.add().CopyFrom(helper.make_node("Cast", [half], [name], to=FLOAT, name=f"{half}_up"))
    return out


def _dequantized_weights(graph: onnx.GraphProto, types: dict[str, int]) -> dict[str, onnx.NodeProto]:
    """Each DequantizeLinear of constants (an INT8 or FP8 weight) that :func:`_write_dequantized` can compute, by
    output; blocked ones (INT4 weights) stay nodes, their outputs rounded to FP16 as any other FP16 tensor."""
    constants = {t.name for t in graph.initializer}
    return {node.output[0]: node for node in graph.node
            if node.op_type == "DequantizeLinear" and node.domain in ("", "ai.onnx") and len(node.output) == 1
            and all(name in constants for name in node.input if name)
            and types.get(node.output[0]) in (FLOAT, FLOAT16)
            and not any(a.name == "block_size" for a in node.attribute)}


def _write_dequantized(graph: onnx.GraphProto, node: onnx.NodeProto, dtype: int, target: onnx.GraphProto) -> None:
    """Append the output of ``node`` (a DequantizeLinear of constants) to ``target`` as an FP32 initializer.

    Computed as ONNX Runtime does (one float32 product (x - zero) * scale, as its kernel; round to nearest
    even to FP16 where ``dtype`` is FP16, as its Cast), so the emulation reads the weights TensorRT computes
    with. Done here rather than by ONNX Runtime's constant folding, which held every weight in FP32, then in
    FP16, then in FP32 again while it built the session (a 2.25 GiB model's INT8 candidate peaked at 5.6 GiB).
    """
    constants = {t.name: t for t in graph.initializer if t.name in node.input}
    q = tensor_array(constants[node.input[0]])
    scale = tensor_array(constants[node.input[1]]).astype(np.float32)
    zero = tensor_array(constants[node.input[2]]) if len(node.input) > 2 and node.input[2] else np.zeros_like(scale)
    if scale.size > 1 or scale.ndim:  # per axis
        axis = next((int(a.i) for a in node.attribute if a.name == "axis"), 1) % q.ndim
        shape = [1] * q.ndim
        shape[axis] = -1
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    if np.issubdtype(q.dtype, np.integer):
        values = q.astype(np.int32)
        values -= zero.astype(np.int32)
        weight = values.astype(np.float32)
        del values
    else:  # an FP8 weight: its zero point is an FP8 zero
        weight = q.astype(np.float32) - zero.astype(np.float32)
    weight *= scale
    if dtype == FLOAT16:
        weight = weight.astype(np.float16).astype(np.float32)
    t = target.initializer.add()
    t.name, t.data_type = node.output[0], FLOAT
    t.dims.extend(weight.shape)
    t.raw_data = weight.astype("<f4", copy=False).tobytes()


def _fp32_attributes(node: onnx.NodeProto) -> None:
    """Switch the attributes that make ``node`` produce FLOAT16 (dtype, Constant values) to FLOAT."""
    if node.op_type == "Cast":
        return  # Cast(to=FLOAT16) is the rounding itself
    for attr in node.attribute:
        if attr.type == AttributeProto.TENSOR and attr.t.data_type == FLOAT16:
            attr.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(attr.t).astype(np.float32), attr.t.name))
        elif attr.name == "dtype" and attr.type == AttributeProto.INT and attr.i == FLOAT16:
            attr.i = FLOAT
