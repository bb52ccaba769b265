"""Max |x| of a tensor measured inside the graph: the reductions the probe (``calibration/observe.py``) adds, and
how their scalars and a graph input's values become a max |x| (what the FP16 range rule reads).

Only a few numbers per tensor (its max, min and sum; the exact reduction's max |x| and count of infinities where
those bounds are not finite) leave ONNX Runtime, so the measurement costs the memory of plain inference however many
tensors are measured. The model's own infinities are left out of the max and
counted (calibration/masks.py says why); mask biases count in it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper

from calibration.masks import check_finite
from compiler.core.errors import CalibrationError

__all__ = ["add_max_abs_reductions", "reduced_max_abs", "scalar_max_abs", "input_max_abs"]

# the element types whose infinities are counted: ONNX Runtime's CPU IsInf kernels
_INF_CHECKED: dict[int, type[np.generic]] = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}


def add_max_abs_reductions(graph: onnx.GraphProto, names: Iterable[str], types: dict[str, int],
                           exact: Iterable[str] = ()) -> dict[str, tuple[str, ...]]:
    """Add the max |x| of each tensor in ``names`` (node outputs) as scalar graph outputs; returns {tensor: its
    scalar outputs}, which ``reduced_max_abs`` turns into (max |x| of the finite values, count of infinite ones).

    FP32 and FP64 tensors get their bounds: ReduceMax, ReduceMin and ReduceSum, three reads of the tensor and
    nothing written. Where all three are finite the tensor holds no infinity and no NaN (a sum carries both), so
    its max |x| is max(max, -min), the same number the exact reduction gives, which takes six passes (Abs, IsInf,
    Where, ReduceMax; Cast, ReduceSum) and cost 20 times as much on ONNX Runtime's CPU kernels (ViT-B/16: the FP16
    range pass ran three times as long as plain inference). Tensors in ``exact`` (FP32 and FP64 ones whose bounds
    were not finite on some batch) get the exact pair (max |x| of finite values, count of infinite ones); other
    element types the max |x| of every value (Abs, ReduceMax) and "" for the count.

    Each reduction goes right after the node producing its tensor: run in graph order (``in_node_order``),
    a tensor is still freed once its last consumer ran, so the activations live as long as in plain inference.
    """
    exact = set(exact)
    taken = {o for n in graph.node for o in n.output} | {i.name for i in graph.input} | {o.name for o in graph.output}
    reduced: dict[str, tuple[str, ...]] = {}
    reductions: dict[str, list[onnx.NodeProto]] = {}
    parts = ("abs", "isinf", "zero", "finite", "flags", "inf", "max", "min", "sum")
    for name in names:
        stem = f"{name}__absmax"
        while stem in taken or any(f"{stem}_{p}" in taken for p in parts):
            stem += "_"
        taken.update({stem, *(f"{stem}_{p}" for p in parts)})
        elem = types.get(name, TensorProto.FLOAT)
        if elem in _INF_CHECKED and name not in exact:
            outs = (f"{stem}_max", f"{stem}_min", f"{stem}_sum")
            reductions[name] = [helper.make_node(op, [name], [out], name=out, keepdims=0)
                                for op, out in zip(("ReduceMax", "ReduceMin", "ReduceSum"), outs)]
            graph.output.extend(helper.make_tensor_value_info(out, elem, []) for out in outs)
            reduced[name] = outs
            continue
        nodes = [helper.make_node("Abs", [name], [f"{stem}_abs"], name=f"{stem}_abs")]
        if elem in _INF_CHECKED:
            zero = onnx.numpy_helper.from_array(np.zeros((), _INF_CHECKED[elem]))
            nodes += [helper.make_node("IsInf", [f"{stem}_abs"], [f"{stem}_isinf"], name=f"{stem}_isinf"),
                      helper.make_node("Constant", [], [f"{stem}_zero"], name=f"{stem}_zero", value=zero),
                      helper.make_node("Where", [f"{stem}_isinf", f"{stem}_zero", f"{stem}_abs"], [f"{stem}_finite"],
                                       name=f"{stem}_finite"),
                      helper.make_node("ReduceMax", [f"{stem}_finite"], [stem], name=stem, keepdims=0),
                      helper.make_node("Cast", [f"{stem}_isinf"], [f"{stem}_flags"], name=f"{stem}_flags",
                                       to=TensorProto.FLOAT),
                      helper.make_node("ReduceSum", [f"{stem}_flags"], [f"{stem}_inf"], name=f"{stem}_inf",
                                       keepdims=0)]
            graph.output.append(helper.make_tensor_value_info(f"{stem}_inf", TensorProto.FLOAT, []))
            reduced[name] = (stem, f"{stem}_inf")
        else:
            nodes.append(helper.make_node("ReduceMax", [f"{stem}_abs"], [stem], name=stem, keepdims=0))
            reduced[name] = (stem, "")
        reductions[name] = nodes
        graph.output.append(helper.make_tensor_value_info(stem, elem, []))
    nodes = list(graph.node)
    del graph.node[:]
    for node in nodes:
        graph.node.append(node)
        for out in node.output:
            graph.node.extend(reductions.get(out, []))
    return reduced


def reduced_max_abs(scalars: tuple[float, ...]) -> tuple[float, float] | None:
    """(max |x| of the finite values, count of infinite values) from the scalars of one tensor's reductions
    (``add_max_abs_reductions``); None where they are a tensor's bounds that are not all finite (an infinity, a NaN,
    a sum past FP32's range, no values at all): then only the exact reduction can say."""
    if len(scalars) == 2:
        return scalars[0], scalars[1]
    top, low, total = scalars
    if not (math.isfinite(top) and math.isfinite(low) and math.isfinite(total)):
        return None
    return abs(max(top, -low)), 0.0  # abs: an all-zero tensor's max |x| is 0.0, never -0.0


def scalar_max_abs(index: int, name: str, value: float, infinities: float, in_cone: bool,
                    is_output: bool) -> tuple[float, int]:
    """A tensor's max |x| from its in-graph reduction, and its count of the model's own infinities (left out of
    the max: calibration/masks.py). A mask-bias tensor's infinities count in its max, as before any of this: they
    are biases. NaN, and Inf in a graph output, raise."""
    if in_cone and infinities:
        value = math.inf
    if math.isnan(value) or math.isnan(infinities) or (math.isinf(value) and not in_cone) \
            or (infinities and is_output and not in_cone):
        raise CalibrationError(f"batch {index}: tensor {name!r} has NaN or Inf values; check that batch's "
                               "data (scaling, dtype, uninitialised arrays) or the model")
    return value, 0 if in_cone else int(infinities)


def input_max_abs(index: int, name: str, array: np.ndarray, in_cone: bool, threshold: float) -> float:
    """The max |x| of a graph input read from the feed, every value counted (mask biases too)."""
    flat = array.ravel()
    check_finite(index, name, flat[flat > -threshold] if in_cone else flat)
    return max(float(flat.max()), -float(flat.min())) if flat.size else 0.0
