"""What calibration leaves out of the statistics: padding positions and attention-mask biases.

The ONNX Runtime probe (``collect_histograms``) asks this module which tensors a mask bias can reach
(``mask_bias_cone``), which graph inputs are padding masks (``padding_mask_inputs``, ``padding_mask``) and,
batch by batch, which values of a tensor enter its histogram (``kept_values``). With ``exclude_masked=False``
every value is kept and only the NaN/Inf check applies.

What ``exclude_masked=True`` leaves out
---------------------------------------
*Padding.* An attention mask is a graph input of integer or bool type whose name contains ``mask``, fed
as a [B, S] array with 1 = real token and 0 = padding (the Hugging Face convention; PyTorch's
``key_padding_mask``, where True means padding, is the opposite and is not detected). With such a feed:

* a tensor whose two leading dims are [B, S] (token activations [B, S, ...]) keeps only the positions
  where mask == 1;
* a tensor shaped [B, ..., S, S] (attention scores) keeps element [b, ..., q, k] only where both query q
  and key k are real tokens. It must have at least 4 dims ([B, H, S, S]), or 3 dims and lie in the
  mask-bias cone below, so that a [B, S, D] tensor with D == S is not mistaken for scores.

*Mask biases.* Values <= -``mask_bias_threshold`` (default 1000.0; -inf included) are left out of every
tensor in the mask-bias cone: the tensors computed from a mask input (any graph input whose name contains
``mask``) or from a constant holding such values (a baked causal mask, a ``-1e9`` or ``finfo.min`` fill),
following only inputs whose values reach the output (not Gather indices, Reshape shapes, Where
conditions) and stopping at Softmax, which turns a masked score into a probability of exactly 0. Why
1000: the biases in use are -1e4, -1e9, -65504 and finfo.min, all far below it, while a real pre-Softmax
score of -1000 already has weight exp(-1000) == 0 in FP32, so no value that matters is lost. Values
below the threshold outside the cone (large real activations) are kept.

*The model's own infinities.* The calibration inputs are finite (``calibration/data.py`` checks every sample),
so an infinite value inside the graph is the model's own: T5's relative-position bucketing takes log(0) = -inf
and masks it away with a Where. Such values are left out of the statistics as mask biases are, and counted
(``kept_values`` returns how many), so that calibration keeps those tensors out of INT8; FP16 stores inf as it
is. An infinite value in a graph output is no such mask: it raises, as NaN anywhere does, a
``CalibrationError`` naming the batch and the tensor.

Arrays are numpy arrays, or torch tensors on one device when the probe bins on a GPU: the same indexing
works on either.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Collection
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from compiler.core.errors import CalibrationError
from compiler.core.onnx_io import outer_scope_names

__all__ = ["DEFAULT_MASK_BIAS_THRESHOLD", "mask_bias_cone", "padding_mask_inputs", "padding_mask", "kept_values",
           "check_finite", "finite_values", "log_exclusions", "log_infinities"]

log = logging.getLogger(__name__)

DEFAULT_MASK_BIAS_THRESHOLD = 1000.0
_MAX_SEED_CONSTANT = 1 << 22  # constants up to 4M elements (a 2048 x 2048 causal mask) are scanned for biases
_FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16})
_MASK_TYPES = frozenset({TensorProto.BOOL, TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16,
                         TensorProto.INT32, TensorProto.INT64})

# Inputs (by position) that steer where data goes but whose values never reach the output: a mask bias
# does not flow through them.
_INDEX_INPUTS: dict[str, frozenset[int]] = {
    "Gather": frozenset({1}), "GatherElements": frozenset({1}), "GatherND": frozenset({1}),
    "Reshape": frozenset({1}), "Expand": frozenset({1}), "Tile": frozenset({1}), "Where": frozenset({0}),
    "Slice": frozenset({1, 2, 3, 4}), "Unsqueeze": frozenset({1}), "Squeeze": frozenset({1}),
    "Pad": frozenset({1, 3}), "ReduceSum": frozenset({1}), "ReduceMean": frozenset({1}),
    "ReduceMax": frozenset({1}), "ReduceMin": frozenset({1}), "TopK": frozenset({1}),
}
# Outputs that describe shapes or positions, never values.
_SHAPE_OPS = frozenset({"Shape", "Size", "NonZero", "ArgMax", "ArgMin", "ConstantOfShape", "EyeLike", "Range"})
# A mask bias ends here: masked positions come out as exactly 0.
_BIAS_SINKS = frozenset({"Softmax"})


# -- the graph: where masks and mask biases are -------------------------------------------------------------------

def padding_mask_inputs(graph: onnx.GraphProto, inputs: Collection[str]) -> tuple[str, ...]:
    """The graph inputs among ``inputs`` that can be padding masks: integer or bool, ``mask`` in the name."""
    return tuple(i.name for i in _mask_inputs(graph, inputs) if i.type.tensor_type.elem_type in _MASK_TYPES)


def mask_bias_cone(graph: onnx.GraphProto, inputs: Collection[str], threshold: float,
                   weights_dir: Path | None = None) -> frozenset[str]:
    """Every tensor a mask bias can reach, through value-carrying inputs, up to Softmax.

    The biases start at the mask inputs among the graph's ``inputs`` (of any type) and at the constants
    holding a value <= -``threshold`` (initializers of up to 4M elements, read from ``weights_dir`` when
    their data is external, and Constant/ConstantOfShape nodes).
    """
    cone = {i.name for i in _mask_inputs(graph, inputs)} | _bias_constants(graph, threshold, weights_dir)
    if not cone:
        return frozenset()
    for node in graph.node:  # ONNX graphs list nodes in topological order
        if node.op_type in _SHAPE_OPS or node.op_type in _BIAS_SINKS:
            continue
        skipped = _INDEX_INPUTS.get(node.op_type, frozenset())
        carried = [name for pos, name in enumerate(node.input) if pos not in skipped]
        if any(name in cone for name in carried) or not cone.isdisjoint(outer_scope_names(node)):
            cone.update(out for out in node.output if out)
    return frozenset(cone)


def _mask_inputs(graph: onnx.GraphProto, inputs: Collection[str]) -> list[onnx.ValueInfoProto]:
    return [i for i in graph.input if i.name in inputs and "mask" in i.name.lower()]


def _bias_constants(graph: onnx.GraphProto, threshold: float, weights_dir: Path | None = None) -> set[str]:
    """Initializers and Constant/ConstantOfShape outputs holding a value <= -threshold (baked mask biases)."""
    found = set()
    for init in graph.initializer:
        if init.data_type in _FLOAT_TYPES and math.prod(init.dims) <= _MAX_SEED_CONSTANT \
                and _holds_bias(numpy_helper.to_array(init, str(weights_dir or "")), threshold):
            found.add(init.name)
    for node in graph.node:
        if node.op_type in ("Constant", "ConstantOfShape") \
                and any(_holds_bias(_attribute_values(attr), threshold) for attr in node.attribute):
            found.update(out for out in node.output if out)
    return found


def _attribute_values(attr: onnx.AttributeProto) -> np.ndarray:
    """The float values a Constant-like attribute holds (empty for any other kind)."""
    if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type in _FLOAT_TYPES:
        return numpy_helper.to_array(attr.t)
    if attr.type == onnx.AttributeProto.FLOAT:
        return np.array([attr.f])
    if attr.type == onnx.AttributeProto.FLOATS:
        return np.array(attr.floats)
    return np.zeros(0)


def _holds_bias(values: np.ndarray, threshold: float) -> bool:
    return bool(values.size) and float(np.min(values)) <= -threshold


# -- a batch: which values are kept ------------------------------------------------------------------------------

def padding_mask(feed: dict[str, np.ndarray], masks: tuple[str, ...]) -> np.ndarray | None:
    """The first of the ``masks`` inputs fed as a [B, S] array, as bools (True = real token); None if none is."""
    for name in masks:
        if feed[name].ndim == 2:
            return feed[name] != 0
    return None


def kept_values(index: int, name: str, array: Any, mask: Any, in_cone: bool, exclude_masked: bool,
                threshold: float, is_output: bool = False) -> tuple[Any, int]:
    """The flattened values of tensor ``name`` of batch ``index`` that enter the statistics, and how many of its
    values were the model's own infinities (left out: the module docstring).

    ``mask`` is the batch's padding mask (or None); ``in_cone`` says whether the tensor lies in the mask-bias
    cone; ``is_output``: it is a graph output. Raises CalibrationError on NaN, or on Inf in a graph output that is
    not a mask bias.
    """
    if mask is not None:
        array = _unpadded(array, mask, in_cone)
    flat = array.ravel()
    if in_cone:
        biases = flat <= -threshold
        check_finite(index, name, flat[~biases])
        return (flat[~biases] if exclude_masked else flat), 0
    if is_output:
        check_finite(index, name, flat)
        return flat, 0
    return finite_values(index, name, flat)


def finite_values(index: int, name: str, flat: Any) -> tuple[Any, int]:
    """The finite values of ``flat`` (numpy or torch) and the count of infinite ones; raises on NaN."""
    infinite: Any
    if isinstance(flat, np.ndarray):
        infinite = np.isinf(flat)
        count, nan = int(np.count_nonzero(infinite)), bool(np.isnan(flat).any())
    else:
        import torch

        infinite = torch.isinf(flat)
        count, nan = int(infinite.sum()), bool(torch.isnan(flat).any())
    if nan:
        check_finite(index, name, flat)
    return (flat[~infinite] if count else flat), count


def _unpadded(array: Any, mask: Any, in_cone: bool) -> Any:
    """The elements of ``array`` at real-token positions (see the module docstring for the two shapes)."""
    b, s = mask.shape
    shape = array.shape
    if array.ndim >= 3 and shape[0] == b and shape[-2:] == (s, s) and (array.ndim >= 4 or in_cone):
        pairs = mask[:, :, None] & mask[:, None, :]
        keep = pairs.reshape((b,) + (1,) * (array.ndim - 3) + (s, s))
        return array[np.broadcast_to(keep, shape) if isinstance(keep, np.ndarray) else keep.expand(shape)]
    if array.ndim >= 2 and shape[:2] == (b, s):
        return array[mask]
    return array


def check_finite(index: int, name: str, values: Any) -> None:
    """Raise CalibrationError naming batch ``index`` and tensor ``name`` if ``values`` hold NaN or Inf."""
    if isinstance(values, np.ndarray):
        bad, total = int(np.count_nonzero(~np.isfinite(values))), int(values.size)
    else:
        import torch

        bad, total = int((~torch.isfinite(values)).sum()), int(values.numel())
    if bad:
        raise CalibrationError(f"batch {index}: tensor {name!r} has {bad} NaN or Inf value(s) of {total}; "
                               "check that batch's data (scaling, dtype, uninitialised arrays) or the model")


def log_exclusions(excluded: dict[str, int], threshold: float) -> None:
    """Log how many values of each tensor were left out (``excluded``: tensor -> count)."""
    touched = {name: count for name, count in excluded.items() if count}
    if touched:
        log.info("left %d values of %d tensors out of their histograms: padding positions or mask biases <= -%g",
                 sum(touched.values()), len(touched), threshold)
    for name, count in touched.items():
        log.debug("left %d values of %s out of its histogram", count, name)


def log_infinities(infinite: dict[str, int]) -> None:
    """Log the tensors that held the model's own infinities (``infinite``: tensor -> count of values)."""
    touched = {name: count for name, count in infinite.items() if count}
    if not touched:
        return
    names = sorted(touched)
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    log.info("%d tensor(s) hold infinities the model computes from finite inputs (%s; log(0) masked downstream, "
             "say): left out of their ranges, and out of INT8", len(names), shown)
    for name in names:
        log.debug("%s: %d infinite value(s) left out of its range", name, touched[name])
